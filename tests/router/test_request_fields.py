"""Request fields that used to be accepted and ignored now act or are refused: TGI typical_p,
truncate, priority, adapter_id and watermark; OpenAI truncate_prompt_tokens, typical_p,
stream_options.continuous_usage_stats; the priority scheduling policy from AppConfig, over HTTP."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.net import wait_healthy
from tests.router.conftest import BASE

pytestmark = pytest.mark.slow

TEXT = "The lighthouse keeper wrote about ships, storms and the long winter nights. " * 3


def _post(url, path, body):
    return httpx.post(url + path, json=body, timeout=120)


def test_tgi_truncate_and_typical_p(base_url):
    full = _post(
        base_url,
        "/generate",
        {"inputs": TEXT, "parameters": {"max_new_tokens": 4, "decoder_input_details": True, "details": True}},
    )
    cut = _post(base_url, "/generate", {"inputs": TEXT, "parameters": {"max_new_tokens": 4, "truncate": 8, "decoder_input_details": True, "details": True}})  # fmt: skip
    assert full.status_code == cut.status_code == 200, cut.text
    assert len(cut.json()["details"]["prefill"]) == 8 < len(full.json()["details"]["prefill"])
    seeded = {
        "inputs": "Once upon a time",
        "parameters": {"max_new_tokens": 24, "do_sample": True, "seed": 3, "temperature": 1.5},
    }
    plain = _post(base_url, "/generate", seeded).json()["generated_text"]
    seeded["parameters"]["typical_p"] = 0.2
    typical = _post(base_url, "/generate", seeded).json()["generated_text"]
    assert typical != plain


@pytest.mark.parametrize("field", [{"watermark": True}])
def test_tgi_refuses_what_it_cannot_do(base_url, field):
    r = _post(base_url, "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2, **field}})
    assert r.status_code == 422 and next(iter(field)) in r.text, r.text  # TGI's validation status


def test_tgi_adapter_id_without_lora_is_an_unknown_adapter(base_url):
    r = _post(base_url, "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2, "adapter_id": "my-lora"}})
    assert r.status_code == 404 and "adapter_id" in r.json()["error"], r.text  # TGI's shape


def test_openai_truncate_prompt_tokens(base_url):
    r = _post(base_url, "/v1/completions", {"prompt": TEXT, "max_tokens": 2, "truncate_prompt_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8, r.text
    chat = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 2, "truncate_prompt_tokens": 5}
    r = _post(base_url, "/v1/chat/completions", chat)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5, r.text


def test_continuous_usage_stats(base_url):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"continuous_usage_stats": True}
    usages = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usages.append(json.loads(line[6:]).get("usage"))
    assert usages and all(u is not None for u in usages), usages
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 6 and usages[0]["prompt_tokens"] > 0


@pytest.fixture(scope="module")
def priority_app(serve_cluster, tmp_path_factory, chat_stand_in):
    """One replica of the chat stand-in (tests/tiny_llama.py), one sequence at a time, the
    priority policy, and a watermark key."""
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    key = tmp_path_factory.mktemp("wm") / "key"
    key.write_text("424242\n")
    cfg = AppConfig(
        **BASE,
        model=chat_stand_in,
        num_replicas=1,
        max_num_seqs=1,
        scheduling_policy="priority",
        watermark_key_file=str(key),
    )
    serve.run(build_app(cfg), name="prio", route_prefix="/prio")
    url = f"{serve_cluster['url']}/prio"
    wait_healthy(url)
    yield url
    serve.delete("prio")


def _queue_then_high(url: str, low_and_high) -> list[str]:
    """One sequence at a time: a long request runs, four low-priority ones queue behind it, then
    a high-priority one arrives. Returns the names in the order they finished."""
    finished: list[str] = []

    def run(name: str, send) -> None:
        r = send()
        assert r.status_code == 200, r.text
        finished.append(name)

    # ~7 s of the stand-in's decoding here: well past both sleeps below.
    long = {"prompt": "Story:", "max_tokens": 1000, "ignore_eos": True}
    threads = [threading.Thread(target=run, args=("first", lambda: _post(url, "/v1/completions", long)))]
    threads[0].start()
    time.sleep(1.0)
    for i in range(4):
        threads.append(threading.Thread(target=run, args=(f"low{i}", lambda: low_and_high(5))))
        threads[-1].start()
    time.sleep(1.0)
    threads.append(threading.Thread(target=run, args=("high", lambda: low_and_high(-5))))
    threads[-1].start()
    for t in threads:
        t.join(timeout=300)
    return finished


def test_a_high_priority_request_goes_ahead_of_the_queue(priority_app):
    def send(priority: int) -> httpx.Response:
        body = {"prompt": "Story:", "max_tokens": 10, "ignore_eos": True, "priority": priority}
        return _post(priority_app, "/v1/completions", body)

    finished = _queue_then_high(priority_app, send)
    assert finished.index("high") < min(finished.index(f"low{i}") for i in range(4)), finished


def test_tgi_priority_reaches_the_engine(priority_app):
    def send(priority: int) -> httpx.Response:
        body = {"inputs": "Story:", "parameters": {"max_new_tokens": 10, "priority": priority}}
        return _post(priority_app, "/generate", body)

    finished = _queue_then_high(priority_app, send)
    assert finished.index("high") < min(finished.index(f"low{i}") for i in range(4)), finished


def test_watermarked_outputs_over_http_are_detected(priority_app, base_url):
    tgi = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 120, "do_sample": True, "seed": 5}}
    tgi["parameters"]["watermark"] = True
    marked = _post(priority_app, "/generate", tgi)
    assert marked.status_code == 200, marked.text
    cmpl = {"prompt": "The weather today", "max_tokens": 120, "ignore_eos": True, "seed": 5, "watermark": True}
    marked_openai = _post(priority_app, "/v1/completions", cmpl)
    assert marked_openai.status_code == 200, marked_openai.text
    plain = _post(priority_app, "/v1/completions", {**cmpl, "watermark": False})
    z = {}
    for name, text in (
        ("tgi", marked.json()["generated_text"]),
        ("openai", marked_openai.json()["choices"][0]["text"]),
        ("plain", plain.json()["choices"][0]["text"]),
    ):
        r = _post(priority_app, "/v1/watermark/detect", {"text": text})
        assert r.status_code == 200, r.text
        z[name] = r.json()["z_score"]
    print(f"watermark z-scores over HTTP: {z}")
    ids = _post(priority_app, "/generate", {**tgi, "parameters": {**tgi["parameters"], "details": True}})
    by_ids = _post(
        priority_app, "/v1/watermark/detect", {"token_ids": [t["id"] for t in ids.json()["details"]["tokens"]]}
    )
    assert by_ids.status_code == 200 and by_ids.json()["z_score"] > 4, by_ids.text
    assert z["tgi"] > 4 and z["openai"] > 4 and z["plain"] < 4
    # A deployment without a key refuses both the flag and the detector.
    r = _post(base_url, "/v1/watermark/detect", {"text": "hello there"})
    assert r.status_code == 400 and "watermark" in r.text
    r = _post(base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "watermark": True})
    assert r.status_code == 400 and "watermark" in r.text


# --- fields whose effect each test below shows over HTTP (test_no_field_ignored.py maps them) ---


def _completion(url, **body):
    r = _post(url, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_stop_token_ids_and_include_stop_str(base_url):
    base = _completion(base_url, ignore_eos=True)
    # The greedy tokens' ids, from TGI's details (the same engine, greedy too).
    tgi = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8, "details": True}}
    tokens = _post(base_url, "/generate", tgi).json()["details"]["tokens"]
    assert base["text"].startswith("".join(t["text"] for t in tokens[:3]))
    third = tokens[2]["id"]
    stopped = _completion(base_url, ignore_eos=True, stop_token_ids=[third])
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == third
    assert len(stopped["text"]) < len(base["text"]) and base["text"].startswith(stopped["text"])
    word = base["text"].split()[1]
    cut = _completion(base_url, ignore_eos=True, stop=[word])
    kept = _completion(base_url, ignore_eos=True, stop=[word], include_stop_str_in_output=True)
    assert not cut["text"].endswith(word) and kept["text"] == cut["text"] + word


def test_skip_special_tokens(base_url):
    """logit_bias forces the end-of-turn token (ignore_eos keeps going): it is in the text only
    with skip_special_tokens false."""
    from transformers import AutoTokenizer

    from engine.model.loader import resolve_model_dir

    t = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    special = t.convert_tokens_to_ids("<|im_end|>")
    force = {"max_tokens": 2, "ignore_eos": True, "logit_bias": {str(special): 100}}
    skipped, shown = _completion(base_url, **force), _completion(base_url, **force, skip_special_tokens=False)
    assert "<|im_end|>" not in skipped["text"] and "<|im_end|>" in shown["text"], (skipped, shown)


def test_cache_salt_separates_prefix_caches(base_url):
    prompt = TEXT + " A salted story begins here."
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}

    def cached(salt):
        r = _post(base_url, "/v1/completions", {**body, **({"cache_salt": salt} if salt else {})})
        assert r.status_code == 200, r.text
        return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    cached("tenant-a")  # fills tenant a's blocks (the router may pick any replica; repeat to land)
    assert max(cached("tenant-a") for _ in range(3)) > 0
    assert cached("tenant-b") == 0  # the same prompt, another salt: nothing shared


def test_guided_json_and_guided_grammar(base_url):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    r = _completion(base_url, prompt="Capital of France as JSON:", max_tokens=30, guided_json=schema)
    assert isinstance(json.loads(r["text"])["city"], str), r
    r = _completion(base_url, prompt="Is water wet? Answer:", max_tokens=4, guided_grammar='start: " yes" | " no"')
    assert r["text"] in (" yes", " no"), r


def test_suffix_and_best_of_are_refused(base_url):
    r = _post(base_url, "/v1/completions", {"prompt": "def f(", "suffix": "return x", "max_tokens": 2})
    assert r.status_code == 400 and "suffix" in r.text
    r = _post(base_url, "/v1/completions", {"prompt": "def f(", "best_of": 3, "max_tokens": 2})
    assert r.status_code == 400 and "best_of" in r.text
    assert _completion(base_url, best_of=1, max_tokens=2)["text"]  # best_of = n: what it always does


def test_chat_generation_prompt_fields(base_url):
    def usage(**kw):
        r = _post(base_url, "/v1/chat/completions", {"max_tokens": 4, "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    asked = [{"role": "user", "content": "Name a colour."}]
    with_prompt = usage(messages=asked)["usage"]["prompt_tokens"]
    without = usage(messages=asked, add_generation_prompt=False)["usage"]["prompt_tokens"]
    assert without < with_prompt  # the assistant header is not appended
    started = asked + [{"role": "assistant", "content": "My favourite colour is"}]
    closed = usage(messages=started, add_generation_prompt=False)
    cont = usage(messages=started, continue_final_message=True, add_generation_prompt=False)
    # continued: the assistant turn stays open (no end-of-turn token after it)
    assert cont["usage"]["prompt_tokens"] < closed["usage"]["prompt_tokens"]


def test_tgi_return_full_text(base_url):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4}}
    plain = _post(base_url, "/generate", body).json()["generated_text"]
    body["parameters"]["return_full_text"] = True
    full = _post(base_url, "/generate", body).json()["generated_text"]
    assert full == "The capital of France is" + plain


def test_user_is_logged_with_the_request_id(base_url):
    """OpenAI's `user` names the end user for abuse reviews: it lands in the ingress replica's
    Serve log beside the request id that the response carries."""
    import pathlib
    import uuid

    import ray

    marker = f"end-user-{uuid.uuid4().hex[:8]}"
    r = _post(base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "user": marker})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    logs = pathlib.Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    deadline, lines = time.monotonic() + 20, []
    while not lines and time.monotonic() < deadline:
        lines = [ln for f in logs.glob("*.log") for ln in f.read_text(errors="replace").splitlines() if marker in ln]
        time.sleep(0.2)
    assert lines and rid in lines[0], (rid, lines)
    assert _post(base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "user": "x" * 257}).status_code == 400
