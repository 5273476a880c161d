"""LoRA under disaggregated serving: a decode replica asks its prefill replica for a prompt's KV
with the request's adapter (router/replica/prefill_client.py), so the text equals the colocated
engine's with that adapter, and the base model's prompts still get the base model's KV."""

from __future__ import annotations

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.lora.request import LoRARequest
from tests.disagg.conftest import transfer_counters
from tests.engine.lora_models import ADAPTERS, save_adapter, save_tiny_llama
from tests.serve_cluster import serve_app

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog and keeps on running through the forest"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm_tokenizer):
    root = tmp_path_factory.mktemp("lora-pd")
    save_tiny_llama(root / "base", smollm_tokenizer)
    save_adapter(root / "base", root / "all", seed=2, **ADAPTERS["all"])
    return root


def test_remote_prefill_runs_the_adapter(dirs):
    llm = LLM(str(dirs / "base"), dtype="float32", num_blocks=64, num_threads=1, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(
        [PROMPT, PROMPT], params, use_tqdm=False, lora_request=[LoRARequest("all", 1, str(dirs / "all")), None]
    )
    want = {"all": outs[0].outputs[0].text, "tiny-base": outs[1].outputs[0].text}
    assert want["all"] != want["tiny-base"]
    with serve_app(
        "lora-pd",
        "/lora-pd",
        model=str(dirs / "base"),
        served_model_name="tiny-base",
        dtype="float32",
        kv_cache_memory_bytes=16 << 20,
        num_threads=1,
        num_replicas=1,
        prefill_replicas=1,
        local_prefill_max_tokens=4,
        enable_lora=True,
        max_lora_rank=8,
        lora_modules={"all": str(dirs / "all")},
    ) as app:
        before = transfer_counters(app["url"])
        with httpx.Client(base_url=app["url"], timeout=120) as c:
            for model in ("all", "tiny-base"):
                body = {
                    "model": model,
                    "prompt": PROMPT,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want[model], model
        after = transfer_counters(app["url"])
        assert after["num_remote_prefills"] - before["num_remote_prefills"] == 2
