"""Tensor-parallel benchmark: per-step overhead of the Ray executor (rank 0 in the driver,
ranks 1.. as Ray actors) against in-process, and tokens/s at several tensor-parallel degrees,
on the same batch.

    python -m bench.bench_tp                            # SmolLM2-135M-shaped random Llama, tp 1/2/3
    python -m bench.bench_tp --model default --tp 3     # the embedded SmolLM2 itself (9 heads: tp 1 or 3)

SmolLM2 has 9 heads and 3 KV heads, so it does not split over 2 ranks; the default model is
a random Llama of the same size (hidden 576, 30 layers, vocab 49152) with 12 heads and
6 KV heads, which splits over 1, 2 and 3 ranks. It is built with transformers, never downloaded.

Overhead = time the driver spends in `executor.execute_model` minus the time rank 0 spends
in its model runner (timed in the driver, where rank 0 now runs), per decode step: submitting
the step to the remote ranks and reaping their finished calls. Waiting on a remote rank inside
a collective counts as rank 0's model time, so compare "step ms" and tok/s across tp too.
"empty" is a call with nothing scheduled (no collective: the submit and reap alone).
"lag" is submit -> a remote rank's model runner starting the step, measured from outside the
product classes: the driver's submits are time-stamped by wrapping the executor's `submit`,
the ranks' starts by a wrapper put around each actor's model runner with Ray's `__ray_call__`.

The batch's prompts are loadtest's seeded `uniform` workload at one length (`loadtest.workloads`,
the generator the load tester uses), as token ids cut or filled to exactly `--prompt-len`;
the random Llama is saved with SmolLM2's tokenizer for this (bench/random_llama.py says where
it comes from).
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def smollm_shaped_llama(path) -> str:
    """A random Llama with SmolLM2-135M's sizes but 12 heads / 6 KV heads (divides by 2 and 3),
    saved with SmolLM2's tokenizer (the prompts are token ids of loadtest's text)."""
    from bench.random_llama import save_random_llama

    if not os.path.isfile(os.path.join(path, "config.json")):
        save_random_llama(path, "smollm2-135m-12h", device="cpu")
    return str(path)


def _build(model, dtype, tp, threads, budget):
    from engine.config import CacheConfig, ParallelConfig, SchedulerConfig
    from engine.core.engine_core import EngineCore
    from engine.model_config import build_model_config
    from engine.runner.executor import InProcessExecutor

    mc = build_model_config(model, dtype, torch.device("cpu"))
    cc = CacheConfig(16, True, 256 << 20)
    torch.set_num_threads(threads)  # rank 0 (or the in-process runner) uses the driver's threads
    if tp == 1:
        ex = InProcessExecutor(mc, cc)
    else:
        from workers.ray_executor import RayExecutor

        ex = RayExecutor(mc, cc, ParallelConfig(tp), num_cpus_per_worker=threads)
    return mc, EngineCore(SchedulerConfig(256, budget, mc.max_model_len), cc, ex)


class _Timed:
    """Times the executor from outside, by wrapping methods of its objects (no hooks in them):
    the driver's `execute_model`; the model runner of the in-process executor or of rank 0 (in
    the driver); and, for the Ray executor, the remote ranks' start lag: the driver's submit
    times against the times each rank's model runner starts the step (recorded in the actor by a
    wrapper installed with Ray's `__ray_call__`; same node, same monotonic clock)."""

    def __init__(self, ex):
        self.ex, self.exec_s, self.model_s = ex, 0.0, 0.0
        rank0 = getattr(ex, "rank0", None)
        runner = rank0.runner if rank0 is not None else getattr(ex, "runner", None)
        if runner is not None:
            inner = runner.execute_model

            def timed(so):
                t = time.perf_counter()
                try:
                    return inner(so)
                finally:
                    self.model_s += time.perf_counter() - t

            runner.execute_model = timed
        orig = ex.execute_model

        def outer(so):
            t = time.perf_counter()
            try:
                return orig(so)
            finally:
                self.exec_s += time.perf_counter() - t

        ex.execute_model = outer
        self.sent: list[float] | None = None
        if rank0 is not None:
            import ray

            self.sent = []
            submit = ex.remote.submit

            def stamped(inp):
                self.sent.append(time.perf_counter())
                return submit(inp)

            ex.remote.submit = stamped

            def probe(worker):  # runs in each actor (nested: pickled by value)
                import time as _time

                starts, run = [], worker.runner.execute_model

                def started(so):
                    starts.append(_time.perf_counter())
                    return run(so)

                started.starts = starts
                worker.runner.execute_model = started

            ray.get([w.__ray_call__.remote(probe) for w in ex.workers])

    def _starts(self, clear: bool) -> list[list[float]]:
        """Each remote rank's step start times. `__ray_call__` runs in the actor's default group,
        after every step submitted before it: a barrier, so each rank has started all of them."""
        import ray

        def read(worker):
            starts = worker.runner.execute_model.starts
            out = list(starts)
            if clear:
                starts.clear()
            return out

        return ray.get([w.__ray_call__.remote(read) for w in self.ex.workers])

    def reset(self):
        self.exec_s = self.model_s = 0.0
        if self.sent is not None:
            self._starts(clear=True)
            self.sent.clear()

    def start_lag_s(self):
        """Mean over remote ranks and steps of submit -> the rank starting the step (None at tp=1)."""
        if self.sent is None:
            return None
        per_rank = []
        for starts in self._starts(clear=False):
            assert len(starts) == len(self.sent), (len(starts), len(self.sent))
            per_rank.append(sum(b - a for a, b in zip(self.sent, starts)) / max(1, len(starts)))
        return sum(per_rank) / len(per_rank)

    def rank0_model_s(self):
        return self.model_s


def _requests(mc, tokenizer, batch, prompt_len, new_tokens, tag):
    """`batch` prompts of exactly `prompt_len` token ids: loadtest's seeded `uniform` workload."""
    from engine.sampling_params import SamplingParams
    from engine.text.input_processor import InputProcessor
    from loadtest import workloads
    from loadtest.tokens import HFTokenCounter

    ip = InputProcessor(None, mc, True)
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    cfg = workloads.WorkloadConfig(
        "uniform",
        num_requests=batch,
        seed=0,
        prompt_range=(prompt_len, prompt_len),
        output_range=(new_tokens, new_tokens),
    )
    reqs = []
    for i, spec in enumerate(workloads.build(cfg, HFTokenCounter(tokenizer, "model"))):
        reqs += ip.make_requests(f"{tag}-{i}", workloads.token_ids(spec, tokenizer, prompt_len), sp)
    return reqs


def bench_config(args, tp, threads):
    from transformers import AutoTokenizer

    mc, core = _build(args.model, args.dtype, tp, threads, max(args.batch * args.prompt_len, 64))
    tokenizer = AutoTokenizer.from_pretrained(mc.model_dir)
    timer = _Timed(core.executor)
    try:
        # Per-step overhead: prefill once, warm up, then time decode steps of the same batch.
        for r in _requests(mc, tokenizer, args.batch, args.prompt_len, args.steps + 8, "o"):
            core.add_request(r)
        core.step()
        for _ in range(3):
            core.step()
        from engine.core.scheduler_output import SchedulerOutput

        empty = SchedulerOutput()
        t = time.perf_counter()
        for _ in range(50):
            core.executor.execute_model(empty)
        empty_ms = (time.perf_counter() - t) / 50 * 1e3
        timer.reset()
        t = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        step_ms = (time.perf_counter() - t) / args.steps * 1e3
        exec_ms = timer.exec_s / args.steps * 1e3
        model_ms = timer.rank0_model_s() / args.steps * 1e3
        lag = timer.start_lag_s()
        lag_ms = None if lag is None else lag * 1e3
        while core.has_unfinished_requests():
            core.step()
        # Throughput: a fresh batch from prompt to last token (prefill included).
        for r in _requests(mc, tokenizer, args.batch, args.prompt_len, args.new_tokens, "t"):
            core.add_request(r)
        t, produced = time.perf_counter(), 0
        while core.has_unfinished_requests():
            produced += sum(len(o.new_token_ids) for o in core.step())
        tok_s = produced / (time.perf_counter() - t)
    finally:
        core.shutdown()
    return dict(
        tp=tp,
        executor="in-process" if tp == 1 else "ray (rank 0 local)",
        threads=threads,
        step_ms=step_ms,
        exec_ms=exec_ms,
        model_ms=model_ms,
        overhead_ms=exec_ms - model_ms,
        lag_ms=lag_ms,
        empty_ms=empty_ms,
        tok_s=tok_s,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_tp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=None,
        help="local HF dir or .gguf, 'default' for the embedded SmolLM2 (default: SmolLM2-shaped random Llama)",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp", default="1,2,3", help="tensor-parallel degrees (1 = in-process, no Ray)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (and in-process)")
    args = ap.parse_args(argv)

    import tempfile

    import ray

    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="orbital-bench-")
        args.model = smollm_shaped_llama(tmp.name)
        label = "random Llama, SmolLM2-135M sizes, 12 heads / 6 KV heads"
    else:
        label = "SmolLM2-135M" if args.model == "default" else args.model
        args.model = None if args.model == "default" else args.model
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    rows = [bench_config(args, int(tp), args.threads) for tp in args.tp.split(",")]
    ray.shutdown()
    if tmp is not None:
        tmp.cleanup()

    print(
        f"\nmodel={label} dtype={args.dtype} batch={args.batch} prompt={args.prompt_len} "
        f"decode steps={args.steps} new tokens={args.new_tokens} threads/rank={args.threads} cpus={os.cpu_count()}"
    )
    hdr = f"{'tp':>3} {'executor':<19} {'step ms':>8} {'exec ms':>8} {'model ms':>9} {'overhead ms':>12} {'lag ms':>7} {'empty ms':>9} {'tok/s':>7}"
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        print(
            f"{r['tp']:>3} {r['executor']:<19} {r['step_ms']:8.2f} {r['exec_ms']:8.2f} {r['model_ms']:9.2f} "
            f"{r['overhead_ms']:12.2f} {'-' if r['lag_ms'] is None else format(r['lag_ms'], '.2f'):>7} "
            f"{r['empty_ms']:9.3f} {r['tok_s']:7.1f}"
        )
    print(
        "step = whole engine step; exec = driver time in execute_model; model = rank 0 in its model runner;\n"
        "overhead = exec - model (submitting to the remote ranks, reaping their finished calls); lag = submit ->\n"
        "a remote rank starting the step (rank 0 waits for it in its first collective: inside 'model'); empty = "
        "execute_model with nothing scheduled."
    )
    return rows


if __name__ == "__main__":
    main()
