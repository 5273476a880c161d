"""LoRA adapters over HTTP (router/ingress/lora_adapters.py): an adapter is the OpenAI `model`
(listed in /v1/models with its base as `parent`) and TGI's `adapter_id`; unknown ones are 404s in
each API's shape; /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time. The
served greedy text equals the offline engine's with the same adapter (tests/engine/test_lora.py
holds that one to transformers + peft)."""

from __future__ import annotations

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.lora.request import LoRARequest
from tests.engine.lora_models import ADAPTERS, save_adapter, save_tiny_llama
from tests.serve_cluster import serve_app

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm_tokenizer):
    root = tmp_path_factory.mktemp("lora-http")
    save_tiny_llama(root / "base", smollm_tokenizer)
    for i, name in enumerate(("qv", "all")):
        save_adapter(root / "base", root / name, seed=i + 1, **ADAPTERS[name])
    return root


@pytest.fixture(scope="module")
def expected(dirs) -> dict:
    """Greedy text per adapter (None: the base model), from the offline engine."""
    llm = LLM(str(dirs / "base"), dtype="float32", num_blocks=64, num_threads=1, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    names = [None, "qv", "all"]
    loras = [LoRARequest(n, i, str(dirs / n)) if n else None for i, n in enumerate(names)]
    outs = llm.generate([PROMPT] * 3, params, use_tqdm=False, lora_request=loras)
    return {n: o.outputs[0].text for n, o in zip(names, outs)}


@pytest.fixture(scope="module")
def app(dirs):
    with serve_app(
        "lora",
        "/lora",
        model=str(dirs / "base"),
        served_model_name="tiny-base",
        dtype="float32",
        kv_cache_memory_bytes=16 << 20,
        num_threads=1,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules={"qv": str(dirs / "qv")},
    ) as a:
        yield a


@pytest.fixture(scope="module")
def http(app):
    with httpx.Client(base_url=app["url"], timeout=120) as c:
        yield c


def _complete(http, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return http.post("/v1/completions", json=body)


def test_models_lists_adapters_with_their_parent(http, dirs):
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert cards["qv"]["parent"] == "tiny-base" and cards["qv"]["root"] == str(dirs / "qv")
    assert cards["tiny-base"]["parent"] is None


def test_model_names_the_adapter(http, expected):
    assert expected["qv"] != expected[None]  # else this could not fail
    r = _complete(http, "qv")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected["qv"] and r.json()["model"] == "qv"
    assert _complete(http, "tiny-base").json()["choices"][0]["text"] == expected[None]
    chat = http.post("/v1/chat/completions", json={"model": "qv", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text


def test_unknown_adapter_is_a_404(http):
    r = _complete(http, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post("/generate", json={"inputs": PROMPT, "parameters": {"adapter_id": "nope"}})
    assert r.status_code == 404 and set(r.json()) == {"error", "error_type"}


def test_tgi_adapter_id(http, expected):
    body = {"inputs": PROMPT, "parameters": {"adapter_id": "qv", "max_new_tokens": MAX_TOKENS, "stop": []}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == expected["qv"]


def test_load_and_unload_at_run_time(http, dirs, expected):
    assert _complete(http, "all").status_code == 404
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": str(dirs / "all")})
    assert r.status_code == 200 and "added" in r.text
    r = _complete(http, "all")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected["all"]
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": str(dirs / "all")})
    assert again.status_code == 400
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(dirs / "base")})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 200
    assert _complete(http, "all").status_code == 404
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 404


def test_the_python_handle_loads_and_unloads(app, http, dirs, expected):
    """The Python handle's load_lora_adapter / unload_lora_adapter do what the routes do."""
    handle = app["handle"]
    body = {"lora_name": "all-py", "lora_path": str(dirs / "all")}
    assert "added" in handle.load_lora_adapter.remote(body).result()
    r = _complete(http, "all-py")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected["all"]
    with pytest.raises(Exception, match="adapter_config.json"):
        handle.load_lora_adapter.remote({"lora_name": "bad-py", "lora_path": str(dirs / "base")}).result()
    assert "removed" in handle.unload_lora_adapter.remote({"lora_name": "all-py"}).result()
    assert _complete(http, "all-py").status_code == 404
    with pytest.raises(Exception, match="all-py"):
        handle.unload_lora_adapter.remote({"lora_name": "all-py"}).result()
