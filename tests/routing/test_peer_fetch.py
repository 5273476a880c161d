"""Fetching a prompt's prefix from the replica holding it, over 3 real replicas of the chat
stand-in: a hot prefix's replica loaded past the cache-aware load guard makes the router send
the next request with that prefix elsewhere, with a hint; that replica fetches the prefix's KV
from the holder (through the object store) instead of recomputing it, and answers the same
text. A fetch whose holder is gone, or no longer holds the blocks, recomputes with the same
tokens. Injected from outside: `submit` messages with a hint, sent straight to a replica."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Callable

import httpx
import pytest

from engine.core.block_hash import max_hit_blocks
from engine.kv_transfer.peer_prefix import PeerPrefix
from engine.sampling_params import SamplingParams
from router.messages import StepOutputs, SubmitRequest, decode
from tests.router.conftest import BASE
from tests.serve_cluster import serve_app

pytestmark = pytest.mark.slow

APP, PREFIX = "peer", "/peer"
BS = 16
WORDS = "alpha beta gamma delta river stone cloud ember maple orbit quartz violet harbor lantern meadow".split()
HOT = "Hot tenant instructions: " + " ".join(random.Random(7).choice(WORDS) for _ in range(700)) + "."
QUESTION = "\nUser: " + " ".join(random.Random(8).choice(WORDS) for _ in range(60)) + "? Which is first?\nAnswer:"
MAX_STREAMS = 12  # past the guard's slack (4 in-flight requests) over the idle replicas, with room


@pytest.fixture(scope="module")
def app(chat_stand_in):
    cfg = {**BASE, "model": chat_stand_in, "max_model_len": 2048, "max_num_seqs": 16}
    # `always`: the chosen replica may hold the hot prefix itself (a stream past the guard went
    # there) and measure a prefill of the few blocks left faster than a fetch's round trip; the
    # cost model's choice is tested in tests/router/test_peer_fetch_plan.py.
    with serve_app(APP, PREFIX, **cfg, num_replicas=3, routing="cache-aware", kv_peer_fetch="always") as cluster:
        yield cluster


def _complete(url: str, prompt: str, max_tokens: int = 12) -> dict:
    r = httpx.post(
        f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()


def _stats(app) -> dict[str, dict]:
    return {s["replica_id"]: s for s in app["handle"].replica_stats.remote().result()}


def _decision(app, response_id: str) -> dict:
    got = app["handle"].routing_decisions.remote().result()
    return got.get(response_id) or got[f"{response_id}-0"]


class _Streams:
    """Long greedy streams of the hot prefix, started one after the other (each running before
    the next is sent, so the router sees each one's load) and held open until `close`."""

    def __init__(self, url: str, n: int, until: Callable[[list[str]], bool] = lambda ids: False) -> None:
        """Up to `n` streams; no more once `until(ids of the streams so far)` holds."""
        self.stop = threading.Event()
        self.ids: list[str] = []
        self.errors: list[str] = []
        self.threads = []
        for i in range(n):
            started = threading.Event()
            t = threading.Thread(target=self._run, args=(url, i, started), daemon=True)
            t.start()
            self.threads.append(t)
            assert started.wait(timeout=120), f"stream {i} did not start"
            assert not self.errors, self.errors
            if until(self.ids):
                break

    def _run(self, url: str, i: int, started: threading.Event) -> None:
        body = {
            "prompt": HOT + f"\nUser: recite stream {i}.\nAnswer:",
            "max_tokens": 1200,  # with the ~720-token prompt, within max_model_len
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.Client(timeout=120) as c, c.stream("POST", f"{url}/v1/completions", json=body) as s:
                if s.status_code != 200:
                    self.errors.append(f"stream {i}: {s.status_code} {s.read()[:300]!r}")
                    return
                for line in s.iter_lines():
                    if not started.is_set() and line.startswith("data: "):
                        self.ids.append(json.loads(line[6:])["id"])
                        started.set()
                    if self.stop.is_set():
                        return  # closing the stream aborts the request
        finally:
            started.set()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def test_a_request_sent_past_the_guard_fetches_the_prefix_from_its_holder(app):
    url = app["url"]
    warm = _complete(url, HOT + QUESTION)
    holder = _decision(app, warm["id"])["replica"]
    # Streams of the hot prefix until the router sends one away from the holder: the holder is
    # then past the guard (the load figure counts the engine's queue and KV use besides the
    # streams, so how many that takes depends on the machine).
    streams = _Streams(url, MAX_STREAMS, until=lambda ids: _decision(app, ids[-1])["replica"] != holder)
    try:
        print("streams on the holder:", sum(_decision(app, i)["replica"] == holder for i in streams.ids))
        # The holder's load figure may fall back under the guard between two requests (a stream
        # ends, a stats push): the request is sent again, while the streams still run, until it
        # goes elsewhere.
        for _ in range(3):
            before = _stats(app)
            got = _complete(url, HOT + QUESTION)
            if _decision(app, got["id"])["replica"] != holder:
                break
    finally:
        streams.close()
    d = _decision(app, got["id"])
    fetcher = d["replica"]
    assert fetcher != holder and d["peer_source"] == holder
    assert got["choices"][0]["text"] == warm["choices"][0]["text"]
    n_prompt = got["usage"]["prompt_tokens"]
    hit = max_hit_blocks(n_prompt, BS) * BS  # the holder cached every full block of the prompt
    assert d["peer_tokens"] == d["predicted_cached_tokens"] == hit
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    after = _stats(app)
    # The fetcher may hold the hot prefix itself (a stream past the guard went there): only the
    # blocks past its own hit moved.
    local = after[fetcher]["prefix_cache_hits"] - before[fetcher]["prefix_cache_hits"]
    assert hit - local >= 2 * BS
    assert after[fetcher]["kv_peer_fetches"] == before[fetcher]["kv_peer_fetches"] + 1
    assert after[fetcher]["kv_peer_tokens_fetched"] - before[fetcher]["kv_peer_tokens_fetched"] == hit - local
    assert after[fetcher]["kv_peer_fetch_bytes"] - before[fetcher]["kv_peer_fetch_bytes"] == (
        (hit - local) // BS * after[fetcher]["kv_bytes_per_block"]
    )
    assert after[fetcher]["kv_peer_fetch_failures"] == before[fetcher]["kv_peer_fetch_failures"]
    assert after[holder]["kv_peer_exports"] == before[holder]["kv_peer_exports"] + 1
    assert after[fetcher]["kv_fetch_bytes_per_s"] and after[fetcher]["kv_fetch_latency_s"] is not None
    page = app["handle"].metrics.remote().result().decode()
    assert "orbital:kv_peer_fetches_total" in page and "orbital:kv_peer_fetch_seconds_bucket" in page


def _direct(app, replica: str, prompt: list[int], hint: PeerPrefix | None) -> list[int]:
    """Submit straight to `replica` (as an ingress would, with `hint`) and read its outputs from
    an output channel of a made-up ingress: the generated token ids."""
    from ray import serve

    engine = serve.get_deployment_handle("EngineReplica", APP)
    ingress, rid = f"test-{uuid.uuid4().hex[:8]}", f"direct-{uuid.uuid4().hex[:8]}"
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    msg = SubmitRequest(rid, prompt, params, ingress, time.time(), peer_prefix=hint)
    assert engine.submit.remote(msg, replica_id=replica).result() == replica
    tokens: list[int] = []
    for payload in engine.options(stream=True).output_channel.remote(ingress, replica_id=replica):
        step: StepOutputs = decode(payload)
        assert not step.failures, step.failures
        for out in step.outputs:
            if out.request_id == rid:
                tokens += out.new_token_ids
                if out.finished:
                    return tokens
    raise AssertionError("the output channel ended before the request")


def test_a_fetch_from_a_gone_or_empty_holder_recomputes_the_same_tokens(app):
    stats = _stats(app)
    a, b, c = sorted(stats)
    prompt = [random.Random(3).randrange(100, 40000) for _ in range(20 * BS + 3)]
    hint_tokens = 20 * BS
    gone = _direct(app, b, prompt, PeerPrefix("no-such-replica", hint_tokens))  # the holder left
    # A live replica that never saw this prompt: it answers None.
    prompt2 = prompt[:-1] + [prompt[-1] + 1]
    empty = _direct(app, c, prompt2, PeerPrefix(a, hint_tokens))
    after = _stats(app)
    assert after[b]["kv_peer_fetch_failures"] == stats[b]["kv_peer_fetch_failures"] + 1
    assert after[c]["kv_peer_fetch_failures"] == stats[c]["kv_peer_fetch_failures"] + 1
    assert after[b]["kv_peer_fetches"] == stats[b]["kv_peer_fetches"]
    assert after[a]["kv_peer_exports"] == stats[a]["kv_peer_exports"]
    # Recomputed: the same tokens as a replica that was never told of a peer.
    assert gone == _direct(app, a, prompt, None)
    assert empty == _direct(app, a, prompt2, None)
