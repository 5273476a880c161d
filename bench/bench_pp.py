"""Pipeline-parallel benchmark on one machine's simulated nodes (ray.cluster_utils.Cluster: a head
for the driver's stage and one node per later stage, 1 CPU each; gloo between the stages).

For each model, side by side in one run:
  - one stream: the median decode step at pp=1, 2, 3 (one torch thread per rank), and from it
    the cost of a stage hop: (step at pp=k - step at pp=1) / (k - 1). Each stage computes 1/k
    of the layers, so the layers' total is the same at every k; what grows is the hops (send,
    receive) and the last stage's result coming back to the driver through Ray.
  - throughput: a batch of requests at pp=1 and at pp=2 with micro-batching (two steps in the
    pipe: each stage busy with its own) and without (one step at a time, the other stage idle),
    tokens/s (prompt + output, prefix caching off), alternating, `--reps` times; medians and
    the ratios. The simulated nodes share this machine's cores and memory bus: two stages
    stepping at once each get half its bandwidth, which real nodes would not share.

    python -m bench.bench_pp                                  # the embedded model, float32
    python -m bench.bench_pp --models default llama-1b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

THREADS = 1


def model_path(name: str, workdir: str) -> str | None:
    """None: the embedded model; else a random Llama of bench/random_llama.py's shape, saved once."""
    if name == "default":
        return None
    from bench.random_llama import save_random_llama

    path = os.path.join(workdir, name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        save_random_llama(path, name, device="cpu")
    return path


def build(model: str | None, pp: int, dtype: str, max_num_seqs: int):
    from workers import LLM

    return LLM(
        model,
        pipeline_parallel_size=pp,
        dtype=dtype,
        num_threads=THREADS,
        max_num_seqs=max_num_seqs,
        kv_cache_memory_bytes=512 << 20,
        enable_prefix_caching=False,  # every repetition computes its prompts again
    )


def decode_step_ms(llm, prompt: list[int], new: int) -> float:
    """Median wall time of the decode steps of one stream (the prefill step left out)."""
    from engine import SamplingParams

    eng = llm.engine
    eng.add_request(None, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    times = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[2:])


def throughput(llm, prompts: list[list[int]], new: int) -> float:
    """Tokens computed per second, prompt and output together."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(p) + len(o.outputs[0].token_ids) for p, o in zip(prompts, outs)) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["default"], help="default (embedded) or a bench/random_llama shape")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--stream-tokens", type=int, default=24)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(THREADS)

    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(max(a.pp) - 1):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"CPU: {cpu}; {os.cpu_count()} cores; {a.dtype}; one torch thread per rank")
    workdir = tempfile.mkdtemp(prefix="bench-pp-")
    g = torch.Generator().manual_seed(0)
    try:
        for name in a.models:
            model = model_path(name, workdir)
            prompts = [torch.randint(100, 20000, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]
            print(f"\n## {name}")
            steps = {}
            for pp in a.pp:
                llm = build(model, pp, a.dtype, a.batch)
                try:
                    decode_step_ms(llm, prompts[0], 4)  # warm-up
                    steps[pp] = statistics.median(decode_step_ms(llm, prompts[0], a.stream_tokens) for _ in range(3))
                finally:
                    llm.shutdown()
            print("| pp | one-stream decode step (median ms) | per stage hop (ms) |\n|---|---|---|")
            for pp, ms in steps.items():
                hop = f"{(ms - steps[1]) / (pp - 1):.2f}" if pp > 1 and 1 in steps else "-"
                print(f"| {pp} | {ms:.2f} | {hop} |")

            runs: dict[str, list[float]] = {"pp=1": [], "pp=2, micro-batches": [], "pp=2, one step at a time": []}
            one, two = build(model, 1, a.dtype, a.batch), build(model, 2, a.dtype, a.batch)
            try:
                throughput(one, prompts[:2], 4), throughput(two, prompts[:2], 4)  # warm-up
                for _ in range(a.reps):
                    runs["pp=1"].append(throughput(one, prompts, a.max_tokens))
                    two.engine.core.max_in_flight = 2
                    runs["pp=2, micro-batches"].append(throughput(two, prompts, a.max_tokens))
                    two.engine.core.max_in_flight = 1
                    runs["pp=2, one step at a time"].append(throughput(two, prompts, a.max_tokens))
                seen = two.engine.core.executor.max_in_flight
            finally:
                one.shutdown()
                two.shutdown()
            med = {k: statistics.median(v) for k, v in runs.items()}
            print(f"\n{a.batch} requests x {a.prompt_len} prompt + {a.max_tokens} output tokens, {a.reps} reps")
            print("| engine | tok/s, prompt + output (median) | runs | vs pp=1 |\n|---|---|---|---|")
            for k, v in runs.items():
                print(f"| {k} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in v)} | {med[k] / med['pp=1']:.2f}x |")
            ratio = med["pp=2, micro-batches"] / med["pp=2, one step at a time"]
            print(f"micro-batching vs one step at a time: {ratio:.2f}x (most steps in the pipe: {seen})")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
