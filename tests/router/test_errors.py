"""Bad input gets a 4xx in the OpenAI error shape, and the server keeps serving others meanwhile."""

from __future__ import annotations

import threading

import httpx
import pytest

pytestmark = pytest.mark.slow


def _check(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status in (400, 413) else err["type"])
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def background_stream(base_url):
    """A long streamed request that runs while the bad requests are sent."""
    result = {}

    def run():
        text = ""
        with httpx.stream(
            "POST",
            f"{base_url}/v1/completions",
            timeout=300,
            json={"prompt": "Tell me a story.", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True},
        ) as s:
            for line in s.iter_lines():
                text += line
        result["ok"] = s.status_code == 200 and "[DONE]" in text and '"finish_reason":"length"' in text

    t = threading.Thread(target=run)
    t.start()
    yield result
    t.join(timeout=300)


def post(base_url, path="/v1/completions", **kw):
    return httpx.post(f"{base_url}{path}", timeout=60, **kw)


def test_invalid_json(base_url, background_stream):
    r = post(base_url, content=b"{not json", headers={"content-type": "application/json"})
    _check(r, 400)
    _check(post(base_url, json=[1, 2]), 400)


def test_missing_and_wrong_fields(base_url):
    _check(post(base_url, json={"max_tokens": 4}), 400, "prompt")
    _check(post(base_url, json={"prompt": "hi", "max_tokens": "lots"}), 400, "max_tokens")
    _check(post(base_url, json={"prompt": "hi", "temperature": "hot"}), 400, "temperature")
    _check(post(base_url, "/v1/chat/completions", json={"messages": "hello"}), 400, "messages")
    _check(post(base_url, "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
    _check(post(base_url, "/v1/chat/completions", json={}), 400, "messages")


def test_bad_values(base_url):
    _check(post(base_url, json={"prompt": "hi", "max_tokens": 0}), 400, "max_tokens")
    _check(post(base_url, json={"prompt": "hi", "max_tokens": -5}), 400, "max_tokens")
    _check(post(base_url, json={"prompt": "hi", "top_p": 2.0}), 400, "top_p")
    _check(post(base_url, json={"prompt": "", "max_tokens": 4}), 400, "prompt")
    _check(post(base_url, json={"prompt": [10**9], "max_tokens": 4}), 400, "prompt")
    _check(
        post(
            base_url,
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        ),
        400,
        "max_completion_tokens",  # the field the client sent
    )


def test_prompt_over_context_length(base_url):
    r = post(base_url, json={"prompt": "hello " * 9000, "max_tokens": 4})
    err = _check(r, 400)
    assert "context length" in err["message"]
    r = post(base_url, json={"prompt": "hello", "max_tokens": 100000})
    assert "context length" in _check(r, 400, "max_tokens")["message"]


def test_unknown_model_and_route(base_url):
    err = _check(post(base_url, json={"model": "gpt-17", "prompt": "hi"}), 404, "model")
    assert err["code"] == "model_not_found"
    _check(httpx.get(f"{base_url}/v1/nothing-here", timeout=30), 404)


def test_huge_body(serve_cluster):
    url, key = serve_cluster["strict_url"], serve_cluster["strict_key"]
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {key}"},
        json={"prompt": "x" * (100 << 10), "max_tokens": 1},
    )
    _check(r, 413)


def test_non_finite_numbers(base_url, background_stream):
    """NaN and infinity in any spelling are a 400 naming the field, on both APIs."""
    for raw in (
        b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}',
        b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e999}',
        b'{"prompt": "hi", "max_tokens": 2, "temperature": "NaN"}',
        b'{"prompt": "hi", "max_tokens": 2, "top_p": -Infinity}',
    ):
        err = _check(post(base_url, content=raw, headers={"content-type": "application/json"}), 400)
        assert err["param"] in ("temperature", "top_p"), err
    r = post(
        base_url,
        "/generate",
        content=b'{"inputs": "hi", "parameters": {"temperature": NaN}}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text


def test_deeply_nested_json(base_url):
    _check(post(base_url, content=b"[" * 100_000 + b"]" * 100_000, headers={"content-type": "application/json"}), 400)
    nested = b'{"prompt": "hi", "user": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    _check(post(base_url, content=nested, headers={"content-type": "application/json"}), 400)


def test_chat_template_kwargs_cannot_replace_the_template(base_url):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for key, value in (("chat_template", "{{ 'owned' }}"), ("tokenize", True), ("tools", [{"type": "function"}])):
        err = _check(
            post(base_url, "/v1/chat/completions", json={**chat, "chat_template_kwargs": {key: value}}),
            400,
            "chat_template_kwargs",
        )
        assert key in err["message"]
    # Variables the template does not read are dropped, not an error (clients send them generically).
    r = post(base_url, "/v1/chat/completions", json={**chat, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


def test_content_type_must_be_json(base_url):
    r = post(
        base_url,
        content=b'{"prompt": "hi", "max_tokens": 2}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    err = _check(r, 415)
    assert "application/json" in err["message"]
    r = post(base_url, "/generate", content=b'{"inputs": "hi"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error_type"] == "validation", r.text
    r = httpx.post(base_url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', timeout=60)
    assert r.status_code == 415, r.text  # no Content-Type at all (a page's beacon): refused too


def test_a_foreign_host_name_is_refused_on_loopback(base_url):
    """The app serves loopback without a key: a request naming another host (a page whose name
    was rebound to 127.0.0.1) is refused; localhost and loopback addresses are served."""
    body = {"prompt": "hi", "max_tokens": 1}
    r = httpx.post(base_url + "/v1/completions", json=body, headers={"Host": "evil.example:8000"}, timeout=60)
    assert r.status_code == 403 and "Host" in r.json()["error"]["message"], r.text
    port = base_url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]"):
        r = httpx.post(base_url + "/v1/completions", json=body, headers={"Host": host}, timeout=60)
        assert r.status_code == 200, (host, r.text)


def test_non_ascii_authorization_is_a_401(serve_cluster):
    url = serve_cluster["strict_url"]
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2},
        timeout=30,
        headers=[(b"authorization", "Bearer clé-ünïcødé".encode())],
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text


def test_others_kept_serving(base_url, background_stream):
    r = post(base_url, json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200


def test_background_stream_finished(background_stream):
    import time

    for _ in range(600):
        if "ok" in background_stream:
            break
        time.sleep(0.5)
    assert background_stream.get("ok") is True
