"""Faults in disaggregated serving, injected from outside: transfers that cannot finish in time
(a second app with a 1 ms transfer budget and policy `fail` answers a clear 503; `recompute`,
the default, is what the kill below exercises), and SIGKILL of the prefill replica's process while long prompts
are being prefilled there: every request ends with its full output (the decode replica computes
what the dead prefill replica did not send), the failures are counted, and the pools get every
block back."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine import SamplingParams
from tests.disagg.conftest import PD_BASE, transfer_counters, wait_pools_idle
from tests.disagg.test_outputs import DOC, _client, _complete

pytestmark = pytest.mark.slow


def test_failed_transfers_follow_the_policy(pd_cluster, reference_llm, policy="fail"):
    import httpx

    from router.config import AppConfig
    from tests.serve_cluster import run_app

    url = pd_cluster["url"]
    cfg = AppConfig(**PD_BASE, kv_transfer_failure=policy, kv_transfer_timeout_s=0.001)
    prefix = f"/{policy}"
    handle = run_app(cfg, f"pd-{policy}", url, route_prefix=prefix)
    try:
        prompt = f"Policy {policy}. " + DOC * 2
        r = httpx.post(f"{url}{prefix}/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
        if policy == "fail":
            assert r.status_code >= 500 and "remote prefill failed" in r.json()["error"]["message"], r.text
        else:
            [ref] = reference_llm.generate([prompt], [SamplingParams(max_tokens=12, temperature=0)], use_tqdm=False)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.outputs[0].text
        assert transfer_counters(f"{url}{prefix}")["kv_transfer_failures"] >= 1
        asyncio.run(wait_pools_idle(handle))
    finally:
        from ray import serve

        serve.delete(f"pd-{policy}")


def test_prefill_replica_killed_mid_transfer(pd_cluster, reference_llm):
    url, handle = pd_cluster["url"], pd_cluster["handle"]
    prompts = [f"Volume {i}. " + DOC * 4 + "What happened next?" for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0)
    refs = reference_llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
    before = transfer_counters(url)

    async def run():
        [prefill] = await handle.replica_stats.remote("prefill")
        c = _client(url)
        tasks = [asyncio.create_task(_complete(c, p, max_tokens=20, temperature=0)) for p in prompts]
        # Kill once the prefill replica has work in flight (or at the latest after 1 s).
        for _ in range(50):
            s = await handle.replica_stats.remote("prefill")
            if s and (s[0]["num_running"] or s[0]["num_waiting"] or s[0]["prompt_tokens"] > prefill["prompt_tokens"]):
                break
            await asyncio.sleep(0.02)
        os.kill(prefill["pid"], signal.SIGKILL)
        return await asyncio.gather(*tasks)

    got = asyncio.run(run())
    for ref, resp in zip(refs, got):
        assert resp.choices[0].text == ref.outputs[0].text
        assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    after = transfer_counters(url)
    assert after["kv_transfer_failures"] > before["kv_transfer_failures"]
    stats = handle.replica_stats.remote().result()
    assert all(s["blocks_used"] == 0 for s in stats)
    asyncio.run(_decode_idle(handle))


async def _decode_idle(handle) -> None:
    # The prefill pool is being replaced by Serve (its replica died): only the decode side here.
    for _ in range(60):
        stats = await handle.replica_stats.remote()
        if all(s["blocks_used"] == 0 and not s["num_running"] for s in stats):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"decode pool still holds blocks: {stats}")
