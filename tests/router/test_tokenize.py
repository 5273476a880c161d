"""vLLM's /tokenize and /detokenize (router/ingress/tokenize_api.py): over HTTP against the
`main` app, the counts equal what the completion routes bill; without Ray, each field's effect
on the ids, with a chat template that renders tools and a variable, and a tokenizer that adds a
special token."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% if enable_thinking %}THINK\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_counts_equal_what_the_completion_routes_bill(base_url, client):
    prompt = "The lighthouse keeper counted the ships."
    tok = _post(base_url, "/tokenize", {"prompt": prompt})
    assert tok.status_code == 200, tok.text
    body = tok.json()
    done = client.completions.create(model="", prompt=prompt, max_tokens=1)
    assert body["count"] == len(body["tokens"]) == done.usage.prompt_tokens
    assert body["max_model_len"] == client.models.list().data[0].max_model_len and body["token_strs"] is None
    chat = _post(base_url, "/tokenize", {"messages": CHAT}).json()
    answered = client.chat.completions.create(model="", messages=CHAT, max_tokens=1)
    assert chat["count"] == answered.usage.prompt_tokens
    bare = _post(base_url, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][: bare["count"]] and bare["count"] < chat["count"]
    strs = _post(base_url, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"] and strs["tokens"] == body["tokens"]
    back = _post(base_url, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}
    assert _post(base_url, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(base_url, path, body, param):
    r = _post(base_url, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_the_model_field_picks_the_pool(base_url):
    r = _post(base_url, "/tokenize", {"model": "no-such-model", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(base_url, "/detokenize", {"model": "no-such-model", "tokens": [1]})
    assert r.status_code == 404


# --- each field's effect, without Ray --------------------------------------------------------


@pytest.fixture(scope="module")
def text_side(smollm_dir):
    """An EngineClient's text side for the embedded model: its real InputProcessor, with a chat
    template that renders tools and `enable_thinking`, and a tokenizer that adds <|im_start|>."""
    import torch
    from tokenizers import processors
    from transformers import AutoTokenizer

    from engine.model_config import build_model_config
    from engine.text.input_processor import InputProcessor

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    tok.chat_template = TEMPLATE
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", tok.convert_tokens_to_ids("<|im_start|>"))]
    )
    mc = build_model_config(None, "float32", torch.device("cpu"), None, None)

    async def text_work(_n, fn, *args):
        return fn(*args)

    return SimpleNamespace(tokenizer=tok, inputs=InputProcessor(tok, mc, True), text_work=text_work)


def _ids(text_side, **body) -> list[int]:
    from router.ingress.tokenize_api import tokenize

    return asyncio.run(tokenize(text_side, 100, body))["tokens"]


def test_each_field_changes_the_ids(text_side):
    start = text_side.tokenizer.convert_tokens_to_ids("<|im_start|>")
    plain = text_side.tokenizer("hello there", add_special_tokens=False).input_ids
    assert _ids(text_side, prompt="hello there") == [start, *plain]  # a prompt: special tokens by default
    assert _ids(text_side, prompt="hello there", add_special_tokens=False) == plain
    chat = _ids(text_side, messages=CHAT)
    assert chat[0] == start and _ids(text_side, messages=CHAT, add_special_tokens=True) == [start, *chat]
    assert len(_ids(text_side, messages=CHAT, add_generation_prompt=False)) < len(chat)
    cont = [*CHAT, {"role": "assistant", "content": "Blue"}]
    continued = text_side.tokenizer.decode(_ids(text_side, messages=cont, continue_final_message=True))
    assert continued.rstrip().endswith("Blue") or "Blue<|im_end|>" in continued
    think = text_side.tokenizer.decode(_ids(text_side, messages=CHAT, chat_template_kwargs={"enable_thinking": True}))
    assert think.startswith("THINK")
    tools = [{"type": "function", "function": {"name": "get_colour", "parameters": {"type": "object"}}}]
    rendered = text_side.tokenizer.decode(_ids(text_side, messages=CHAT, tools=tools))
    assert rendered.startswith("TOOLS") and "get_colour" in rendered
