"""OpenAI's /v1/embeddings (router/ingress/embeddings_api.py) over HTTP against the `main` app (the
embedded model, `last` pooling): the openai SDK's `embeddings.create` unchanged, float and base64,
list and token-id input, usage, `user`, and bad input as 400s in OpenAI's shape. The vectors equal
the offline engine's.

Tolerance against the offline engine: both run the same float32 model and may differ only in the
order of their sums (a batch of another size, a prefix-cache hit computing only the last token).
A float32 dot product of length K moves by about sqrt(K)·u relative to its size (u = 2^-24); over
the model's L = 30 layers of K <= 1536 that is about L·sqrt(K)·u = 7e-5 of the hidden state, and
within a few times that of the unit vector: its L2 distance is held to 1e-3, under which a
different pooling or a different input (distances ~0.1-1) cannot pass."""

from __future__ import annotations

import base64
import math
import pathlib
import time
import uuid

import httpx
import numpy as np
import pytest

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

TEXT = "The lighthouse keeper counted the ships."
TOLERANCE = 1e-3


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=120)


def _dist(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)))


@pytest.fixture(scope="module")
def offline(offline_llm):
    """The offline engine's vectors (last pooling) of TEXT and of two more texts."""
    texts = [TEXT, "Waves broke on the rocks.", "A gull cried."]
    return {t: e.embedding for t, e in zip(texts, offline_llm.embed(texts, pooling="last"))}


def _ids(base_url: str, text: str) -> list[int]:
    return httpx.post(f"{base_url}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]


def test_the_openai_sdk_embeds_unchanged(base_url, client, offline):
    # The SDK asks for base64 by default and decodes it itself.
    r = client.embeddings.create(model="", input=TEXT)
    assert r.object == "list" and len(r.data) == 1 and r.data[0].index == 0 and r.data[0].object == "embedding"
    vec = r.data[0].embedding
    assert len(vec) == 576 and abs(math.fsum(v * v for v in vec) - 1) < 1e-5
    assert _dist(vec, offline[TEXT]) < TOLERANCE
    floats = client.embeddings.create(model="", input=TEXT, encoding_format="float")
    assert _dist(floats.data[0].embedding, offline[TEXT]) < TOLERANCE
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(_ids(base_url, TEXT))
    assert r.model == client.models.list().data[0].id


def test_float_and_base64_lists_and_token_ids(base_url, offline):
    texts = list(offline)
    floats = _post(base_url, {"input": texts, "encoding_format": "float"})
    assert floats.status_code == 200, floats.text
    body = floats.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for d, t in zip(body["data"], texts):
        assert _dist(d["embedding"], offline[t]) < TOLERANCE
    b64 = _post(base_url, {"input": texts, "encoding_format": "base64"}).json()
    for d, t in zip(b64["data"], texts):
        raw = base64.b64decode(d["embedding"])
        assert len(raw) == 4 * 576  # little-endian float32, as OpenAI sends them
        assert _dist(np.frombuffer(raw, dtype="<f4"), offline[t]) < TOLERANCE
    ids = [_ids(base_url, t) for t in texts]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    one = _post(base_url, {"input": ids[0], "encoding_format": "float"}).json()
    assert _dist(one["data"][0]["embedding"], offline[texts[0]]) < TOLERANCE
    many = _post(base_url, {"input": ids, "encoding_format": "float"}).json()
    for d, t in zip(many["data"], texts):
        assert _dist(d["embedding"], offline[t]) < TOLERANCE
    # The model's own size is accepted as `dimensions` (and changes nothing).
    same = _post(base_url, {"input": TEXT, "dimensions": 576, "encoding_format": "float"}).json()
    assert _dist(same["data"][0]["embedding"], offline[TEXT]) < TOLERANCE


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": 5}, "input"),
        ({"input": {"text": "a"}}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": ["a"] * 257}, "input"),
        ({"input": "a " * 9000}, "input"),  # past the context length (8192 tokens)
        ({"input": list(range(8193))}, "input"),
        ({}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 64}, "dimensions"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "user": "x" * 257}, "user"),
        ({"input": "a", "model": 7}, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(base_url, body, param):
    r = _post(base_url, body)
    assert r.status_code == 400, (body, r.status_code, r.text[:300])
    err = r.json()["error"]
    # A list's bad item is named by its index (input.1), as the other routes name theirs.
    assert err["param"].split(".")[0] == param and err["type"] == "invalid_request_error", err


def test_the_model_field_picks_the_pool(base_url, client):
    r = _post(base_url, {"model": "no-such-model", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    name = client.models.list().data[0].id
    assert _post(base_url, {"model": name, "input": "x"}).json()["model"] == name


def test_user_is_logged_with_the_request_id(base_url):
    import ray

    marker = f"end-user-{uuid.uuid4().hex[:8]}"
    assert _post(base_url, {"input": "hi", "user": marker}).status_code == 200
    logs = pathlib.Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    deadline, lines = time.monotonic() + 20, []
    while not lines and time.monotonic() < deadline:
        lines = [ln for f in logs.glob("*.log") for ln in f.read_text(errors="replace").splitlines() if marker in ln]
        time.sleep(0.2)
    assert lines and "request embd-" in lines[0], lines


def test_embeddings_leave_every_kv_block_in_the_pool(base_url):
    from tests.router.conftest import metrics, wait_until

    assert _post(base_url, {"input": ["one more text", "and another"] * 4}).status_code == 200
    assert wait_until(lambda: metrics(base_url)["orbital:kv_cache_usage_perc"] == 0.0)


def test_the_pool_s_pooling_type_reaches_its_engine_and_its_requests():
    """No Ray: `pooling_type` (top level or per pool) is what the pool's engine is built with and
    what its embedding requests carry."""
    from router.config import AppConfig, ModelPool

    cfg = AppConfig(
        pooling_type="mean",
        models=[ModelPool(name="a"), ModelPool(name="b", model="default", pooling_type="last")],
    )
    pools = {p.model_name: p for p in cfg.pool_configs()}
    assert pools["a"].engine_args()["pooling_type"] == "mean"
    assert pools["b"].engine_args()["pooling_type"] == "last"
    assert AppConfig().engine_args()["pooling_type"] == "last"
    with pytest.raises(ValueError):
        AppConfig(pooling_type="max")


def test_the_python_handle_embeds(serve_cluster, offline):
    from engine.errors import InvalidRequestError

    handle = serve_cluster["handle"]
    r = handle.embeddings.remote({"input": [TEXT], "encoding_format": "float"}).result()
    assert r["object"] == "list" and _dist(r["data"][0]["embedding"], offline[TEXT]) < TOLERANCE
    with pytest.raises(InvalidRequestError, match="input"):
        handle.embeddings.remote({"input": []}).result()
