"""TTFT of a prompt that comes back after its KV blocks were evicted: the offload tier (its blocks
loaded back from disk) against recompute (tier off), side by side in one run.

    python -m bench.bench_kv_offload [--tokens 1000 --rounds 3 --medium disk]

Two engines on the embedded SmolLM2-135M, each with a KV pool just larger than one prompt. Per
round and engine: a fresh prompt of `--tokens` random token ids (1 output token), then another
prompt of the same length (the pool turns over: all but a block or two of the first prompt's
blocks are evicted, into the tier when it is on), then the first prompt again, timed: its wall time with one output token is
its TTFT. Medians over the rounds, the engines alternating; the ratio is off over on. The tier's
own cost is printed too: the seconds its ranks spent saving and loading, per block.

    python -m bench.bench_kv_offload --beside 6 [--tokens 400 --rounds 3]

The tier's I/O beside other requests' steps: two engines with the tier on, one whose ranks run
its saves and loads on their I/O thread beside the step's forward (CUDA's default), one on the
step thread before the forward (a CPU's). Per round, `--beside` prompts of `--tokens` tokens (32
output tokens each) come back through a pool that holds about half of them, while `--streams`
fresh requests decode 128 tokens each, so every round saves and loads blocks while other
requests prefill and decode. Medians of the round times (the first round left out) and the step
thread's seconds on the tier per block moved.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--medium", default="disk", choices=["disk", "host"])
    p.add_argument("--offload-bytes", type=int, default=512 << 20)
    p.add_argument("--beside", type=int, default=0, help="the I/O-thread comparison with this many prompts")
    p.add_argument("--streams", type=int, default=4, help="--beside: streams decoding through each round")
    p.add_argument("--cold", action="store_true", help="--beside: the disk tier's pages dropped before each round")
    a = p.parse_args(argv)
    if a.beside:
        return beside(a)
    from engine import LLM, SamplingParams

    block = 16
    num_blocks = a.tokens // block + 2  # one prompt (and a little): the next one evicts it
    common = dict(dtype=a.dtype, num_threads=a.threads, block_size=block, num_blocks=num_blocks)
    engines = {
        "tier on": LLM(kv_offload_bytes=a.offload_bytes, kv_offload_medium=a.medium, **common),
        "tier off (recompute)": LLM(**common),
    }
    params = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(0)

    def prompt() -> dict:
        return {"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(a.tokens)]}

    def run(llm, x) -> list[int]:
        return llm.generate(x, params, use_tqdm=False)[0].outputs[0].token_ids

    ttft: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(a.rounds):
        target, others = prompt(), [prompt()]
        firsts = {}
        for name, llm in engines.items():
            firsts[name] = run(llm, target)
            for o in others:
                run(llm, o)
            t = time.perf_counter()
            again = run(llm, target)
            ttft[name].append(time.perf_counter() - t)
            assert again == firsts[name], (name, again, firsts[name])
            print(f"  round {len(ttft[name])}: {name}: {ttft[name][-1] * 1e3:.0f} ms", flush=True)
    on = engines["tier on"]
    st = on.stats()
    store = on.engine.core.executor.runner.offload
    dtype = on.engine.model_config.dtype
    print(f"SmolLM2-135M {str(dtype)[6:]}, {a.threads} threads, {a.tokens}-token prompt, pool {num_blocks} blocks")
    print(f"offload tier: {a.medium}, {st['offload_capacity_blocks']} blocks of {store.block_nbytes / 1e6:.3f} MB")
    for name, xs in ttft.items():
        print(
            f"  {name:22s} TTFT median {statistics.median(xs) * 1e3:8.1f} ms   ({', '.join(f'{x * 1e3:.0f}' for x in xs)})"
        )
    ratio = statistics.median(ttft["tier off (recompute)"]) / statistics.median(ttft["tier on"])
    print(f"  ratio (off / on): {ratio:.2f}x")
    saved, loaded = st["offload_blocks_saved"], st["offload_blocks_loaded"]
    print(
        f"  tier: {saved} blocks saved, {store.seconds_saving / max(saved, 1) * 1e3:.2f} ms/block; "
        f"{loaded} loaded, {store.seconds_loading / max(loaded, 1) * 1e3:.2f} ms/block; "
        f"hits {st['prefix_cache_hits_offload']} tokens, failures {st['offload_load_failures']}"
    )
    for llm in engines.values():
        llm.shutdown()
    return 0


def beside(a) -> int:
    from engine import LLM, SamplingParams

    block, out_tokens = 16, 32
    per_prompt = -(-(a.tokens + out_tokens) // block)
    # About half the returning prompts besides the streams: each round evicts the rest.
    num_blocks = per_prompt * a.beside // 2 + a.streams * -(-(16 + 4 * out_tokens) // block) + 1
    common = dict(dtype=a.dtype, num_threads=a.threads, block_size=block, num_blocks=num_blocks)
    common.update(kv_offload_bytes=a.offload_bytes, kv_offload_medium=a.medium, max_num_seqs=a.beside + a.streams)
    engines = {"I/O thread": LLM(**common), "step thread": LLM(**common)}
    for name, llm in engines.items():  # each way, whatever this device's default is
        llm.engine.core.executor.runner.offload_io.background = name == "I/O thread"
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(a.tokens)]} for _ in range(a.beside)]
    params = [SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)] * len(prompts)
    # Streams that run through each round beside the returning prompts: fresh short prompts with
    # long outputs, admitted first, so the tier's loads and saves share steps with their work.
    params += [SamplingParams(temperature=0, max_tokens=4 * out_tokens, ignore_eos=True)] * a.streams
    rounds: dict[str, list[float]] = {k: [] for k in engines}
    outs: dict[str, list] = {}
    for r in range(a.rounds + 1):
        for name, llm in engines.items():
            if a.cold:
                llm.engine.core.executor.runner.offload.drop_cached_pages()
            streams = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(16)]} for _ in range(a.streams)]
            t = time.perf_counter()
            done = llm.generate(streams + prompts, params[len(prompts) :] + params[: len(prompts)], use_tqdm=False)
            got = [o.outputs[0].token_ids for o in done[a.streams :]]
            if r:
                rounds[name].append(time.perf_counter() - t)
            assert outs.setdefault(name, got) == got, name  # every round the same tokens
    assert outs["I/O thread"] == outs["step thread"]
    dtype = engines["I/O thread"].engine.model_config.dtype
    print(
        f"SmolLM2-135M {str(dtype)[6:]}, {a.threads} threads, {a.beside} prompts of {a.tokens} tokens "
        f"+ {out_tokens} output tokens per round, pool {num_blocks} blocks, tier: {a.medium}{' (cold)' if a.cold else ''}"
    )
    for name, llm in engines.items():
        st = llm.stats()
        io = llm.engine.core.executor.runner.offload_io
        moved = st["offload_blocks_saved"] + st["offload_blocks_loaded"]
        print(
            f"  tier I/O on the {name:12s} round median {statistics.median(rounds[name]):6.2f} s "
            f"({', '.join(f'{x:.2f}' for x in rounds[name])}); {st['offload_blocks_saved']} blocks saved, "
            f"{st['offload_blocks_loaded']} loaded; step thread on the tier "
            f"{io.seconds_on_step / max(moved, 1) * 1e3:.2f} ms per block (I/O {(io.store.seconds_saving + io.store.seconds_loading) / max(moved, 1) * 1e3:.2f})"
        )
    ratio = statistics.median(rounds["step thread"]) / statistics.median(rounds["I/O thread"])
    print(f"  ratio (step thread / I/O thread): {ratio:.2f}x")
    for llm in engines.values():
        llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
