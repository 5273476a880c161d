"""huggingface_hub.InferenceClient against the TGI routes, streamed and not; /generate, /info."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def hf(base_url):
    hub = pytest.importorskip("huggingface_hub")
    return hub.InferenceClient(base_url=base_url, timeout=120)


def test_text_generation(hf, base_url):
    text = hf.text_generation(PROMPT, max_new_tokens=12)
    assert isinstance(text, str) and text
    # do_sample=False is greedy: the same as the OpenAI route at temperature 0
    r = httpx.post(
        f"{base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}, timeout=120
    ).json()
    assert text == r["choices"][0]["text"]


def test_text_generation_details(hf):
    out = hf.text_generation(PROMPT, max_new_tokens=6, details=True)
    assert out.details.finish_reason == "length"
    assert out.details.generated_tokens == 6 == len(out.details.tokens)
    assert all(t.logprob <= 0 for t in out.details.tokens)
    assert "".join(t.text for t in out.details.tokens) == out.generated_text


def test_text_generation_stream(hf):
    full = hf.text_generation(PROMPT, max_new_tokens=10)
    pieces = list(hf.text_generation(PROMPT, max_new_tokens=10, stream=True))
    assert "".join(pieces) == full
    events = list(hf.text_generation(PROMPT, max_new_tokens=10, stream=True, details=True))
    assert len(events) == 10
    assert events[-1].generated_text == full and events[-1].details.finish_reason == "length"
    assert all(e.generated_text is None for e in events[:-1])


def test_stop_sequence_kept(hf):
    full = hf.text_generation(PROMPT, max_new_tokens=24)
    assert "." in full
    out = hf.text_generation(PROMPT, max_new_tokens=24, stop=["."], details=True)
    assert out.generated_text == full[: full.index(".") + 1]  # TGI keeps the stop sequence
    assert out.details.finish_reason == "stop_sequence"


def test_generate_routes(base_url):
    r = httpx.post(f"{base_url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200 and set(r.json()) == {"generated_text"}
    with httpx.stream(
        "POST", f"{base_url}/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}, timeout=60
    ) as s:
        events = [line for line in s.iter_lines() if line.startswith("data:")]
    assert len(events) == 3 and '"generated_text":null' not in events[-1]
    info = httpx.get(f"{base_url}/info", timeout=30).json()
    assert info["model_id"] == "SmolLM2-135M-Instruct" and info["max_total_tokens"] > 0


def test_validation_error_shape(base_url):
    r = httpx.post(f"{base_url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 0}}, timeout=30)
    assert r.status_code == 422
    assert r.json()["error_type"] == "validation" and "max_new_tokens" in r.json()["error"]
    r = httpx.post(f"{base_url}/generate", json={"parameters": {}}, timeout=30)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
