"""The documented Python API: serve.run(build_app(cfg)) returns a DeploymentHandle to the router;
call it with the same bodies as HTTP, streamed and not."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_handle_completions(serve_cluster):
    handle = serve_cluster["handle"]
    r = handle.completions.remote({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}).result()
    assert r["object"] == "text_completion" and r["usage"]["completion_tokens"] == 6
    chat = handle.chat_completions.remote({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).result()
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert handle.models.remote().result()["data"][0]["id"] == "SmolLM2-135M-Instruct"


def test_handle_streaming(serve_cluster):
    handle = serve_cluster["handle"]
    full = handle.completions.remote({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}).result()
    gen = handle.options(stream=True).completions.remote(
        {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True}
    )
    chunks = list(gen)
    assert len(chunks) > 1
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == full["choices"][0]["text"]
    chat = list(
        handle.options(stream=True).chat_completions.remote(
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
        )
    )
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    tgi = list(
        handle.options(stream=True).generate.remote(
            {"inputs": "Hello", "parameters": {"max_new_tokens": 3}, "stream": True}
        )
    )
    assert len(tgi) == 3 and tgi[-1]["generated_text"] is not None


def test_handle_errors(serve_cluster):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        serve_cluster["handle"].completions.remote({"prompt": "hi", "max_tokens": 0}).result()
