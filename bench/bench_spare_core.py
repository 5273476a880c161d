"""Orbital's server with two settings of how it shares the cores, side by side over HTTP at
concurrency 1 to 16: `--compare spare`, with and without a spare core for small steps
(engine/step_threads.py); `--compare spin`, the served engine's OpenMP spin (GOMP_SPINCOUNT
200000, router/serve_tuning.py) against the offline default of 2000; `--compare ingress`, the
router replica serving HTTP itself (router/direct_ingress.py) against Serve's proxy relaying it;
`--compare channel`, engine outputs through the router's local socket (router/channel_socket.py)
against the Ray streaming call carrying them.

    python -m bench.bench_spare_core [--compare spare|spin|ingress|channel] [--quantization gguf] [--rounds 2]
    python -m bench.bench_spare_core --compare channel --model q4km.gguf --int8-activations --levels 1,8

One `orbital serve` at a time on this machine (two Ray clusters would share the cores): per
round, the server with the first setting and then with the second each start, run every level,
and stop. Same client (`loadtest`), greedy, outputs capped at `--max-output`,
32 mixed requests (4 at concurrency 1). Medians over rounds, and the ratio first / second, with
the CPU each output token cost the router replica and all the server's processes but the engine
replica (Ray's, Serve's controller and proxy, the router).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from bench.bench_http import cpu_timed
from bench.bench_llamacpp import free_port, measure, specs_for
from loadtest.server import ServerProcess
from loadtest.tokens import load_counter

# name: (extra serve flags, environment); the first of each pair is the default.
COMPARE = {
    "spare": {"no spare core": ("--spare-core-max-tokens 0", {}), "spare core (4)": ("--spare-core-max-tokens 4", {})},
    "spin": {"spin 200000": ("", {}), "spin 2000": ("", {"GOMP_SPINCOUNT": "2000"})},
    "ingress": {"direct ingress": ("", {}), "serve proxy": ("--serve-proxy", {})},
    "channel": {"local socket": ("", {}), "ray call": ("", {"ORBITAL_CHANNEL_SOCKET": "0"})},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", choices=sorted(COMPARE), default="spare")
    p.add_argument("--quantization", default="gguf", help="Orbital's weights ('none' for the model dtype)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=None, help="a model directory or GGUF (default: the embedded model)")
    p.add_argument("--int8-activations", action="store_true", help="quantized linears on int8 activations")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--levels", default="1,2,4,8,16")
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    specs = specs_for("mixed", 32, a.max_output, load_counter("smollm2"), 0)
    levels = [int(x) for x in a.levels.split(",")]
    quant = "" if a.quantization == "none" else f" --quantization {a.quantization}"
    quant += (f" --model {a.model}" if a.model else "") + (" --int8-activations" if a.int8_activations else "")
    settings = COMPARE[a.compare]
    results: dict[tuple[str, int], list[dict]] = {}
    for r in range(a.rounds):
        for name, (flags, env) in settings.items():
            port = free_port()
            cmd = (
                f"{sys.executable} -m router.cli serve --host 127.0.0.1 --port {port} --threads {a.threads} "
                f"--dtype {a.dtype}{quant} {flags}"
            )
            url = f"http://127.0.0.1:{port}"
            with ServerProcess(cmd, url, log_path="/tmp/bench_spare_core.log", env=env):
                measure(specs[:4], url, None)  # warm-up
                for lv in levels:
                    work = specs[:4] if lv == 1 else specs
                    m = cpu_timed(lambda: measure(work, url, lv), exclude=set())
                    tokens = sum(s.max_tokens for s in work)  # forced: ignore_eos
                    m["router_ms"] = m["cpu_by_process"].get("ingress", 0.0) / tokens * 1e3
                    m["serving_ms"] = m["serving_cpu_s"] / tokens * 1e3
                    results.setdefault((name, lv), []).append(m)
                    print(
                        f"round {r} {name} c{lv}: {m['tok_s']:.1f} tok/s, ITL p50 {m['itl_p50']:.1f} ms, "
                        f"CPU per token: router {m['router_ms']:.2f} ms, all but the engine {m['serving_ms']:.2f} ms",
                        flush=True,
                    )
    print(f"\n{a.quantization} weights, {a.threads} threads, medians of {a.rounds} rounds\n")
    cols = "tok/s, ITL p50 ms, router / non-engine CPU ms per token"
    print("| concurrency | " + " | ".join(f"{n}: {cols}" for n in settings) + " | tok/s ratio |")
    print("|---|" + "---|" * (len(settings) + 1))
    keys = ("tok_s", "itl_p50", "router_ms", "serving_ms")
    for lv in levels:
        med = {n: {k: statistics.median(m[k] for m in results[(n, lv)]) for k in keys} for n in settings}
        cells = [
            f"{med[n]['tok_s']:.1f}, {med[n]['itl_p50']:.1f}, {med[n]['router_ms']:.2f} / {med[n]['serving_ms']:.2f}"
            for n in settings
        ]
        first, second = (med[n]["tok_s"] for n in settings)
        print(f"| c{lv} | " + " | ".join(cells) + f" | {first / second:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
