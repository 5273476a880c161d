"""Command-line options shared by run, sweep and the bench scripts, and what they build."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict

from loadtest.arrivals import Arrival, Burst, ClosedLoop, Constant, Poisson
from loadtest.client import ClientConfig
from loadtest.metrics import SLO
from loadtest.tokens import TokenCounter, load_counter
from loadtest.workloads import WorkloadConfig

WORKLOADS = ("mixed", "uniform", "shared-prefix", "multi-turn", "long-prompt", "jsonl")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def add_server(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)")
    g.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    g.add_argument(
        "--api",
        choices=("auto", "completions", "chat"),
        default="auto",
        help="auto: chat for message workloads, completions otherwise",
    )
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="force max_tokens output (sends ignore_eos and min_tokens)",
    )
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--timeout", type=float, default=300.0, help="per-request bound, seconds")
    g.add_argument("--api-key", default=None)


def add_workload(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="mixed")
    g.add_argument("--workload-file", default=None, help="JSONL request list (implies --workload jsonl)")
    g.add_argument("--num-requests", "-n", type=int, default=100)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--output-tokens", type=int, default=None, help="same output length for every request")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="'smollm2' (embedded GGUF), a .gguf file or a local HF dir; default: word ratio",
    )
    g.add_argument("--words-per-token", type=float, default=0.75, help="approximation without --tokenizer")
    g.add_argument("--prefix-tokens", type=int, default=512, help="shared-prefix: common prefix length")
    g.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes")
    g.add_argument("--suffix-tokens", type=_range, default=(20, 60), help="shared-prefix: LO-HI")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    g.add_argument("--long-tokens", type=_range, default=(1500, 3500), help="long-prompt: LO-HI")
    g.add_argument("--prompt-range", type=_range, default=(20, 600), help="uniform: prompt tokens LO-HI")
    g.add_argument("--output-range", type=_range, default=(10, 500), help="uniform: output tokens LO-HI")


def add_arrival(p: argparse.ArgumentParser, sweepable: bool = False) -> None:
    g = p.add_argument_group("arrivals and bounds")
    if not sweepable:
        g.add_argument("--rate", type=float, default=None, help="Poisson rate, req/s ('inf': all at once)")
        g.add_argument("--concurrency", type=int, default=None, help="closed loop with this many clients")
        g.add_argument("--burst-size", type=int, default=None, help="bursts of this many requests ...")
        g.add_argument("--constant", action="store_true", help="with --rate: even gaps, not Poisson")
    g.add_argument("--burst-interval", type=float, default=1.0, help="... every this many seconds")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap in-flight requests (open loop)")
    g.add_argument("--duration", type=float, default=600.0, help="stop sending after this many seconds")
    g.add_argument("--max-requests", type=int, default=None, help="send at most this many")
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="after --duration, seconds in-flight requests get (default: --timeout + 5)",
    )


def add_slo_output(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SLOs and output")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--slo-e2e-ms", type=float, default=None)
    g.add_argument("--label", default=None)
    g.add_argument("--no-progress", action="store_true")
    g.add_argument(
        "--scrape-metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read the server's /metrics: prefix-cache counters before and after, and its running batch, "
        "queue depth, KV usage, preemptions and prefix hit rate during the run",
    )
    g.add_argument(
        "--metrics-interval-s", type=float, default=1.0, help="seconds between /metrics samples during the run"
    )


def client_config(a) -> ClientConfig:
    return ClientConfig(
        base_url=a.base_url,
        model=a.model,
        api=a.api,
        ignore_eos=a.ignore_eos,
        temperature=a.temperature,
        timeout=a.timeout,
        api_key=a.api_key,
    )


def workload_config(a) -> WorkloadConfig:
    name = "jsonl" if a.workload_file else a.workload
    return WorkloadConfig(
        name=name,
        num_requests=a.num_requests,
        seed=a.seed,
        output_tokens=a.output_tokens,
        path=a.workload_file,
        prefix_tokens=a.prefix_tokens,
        num_prefixes=a.num_prefixes,
        suffix_range=a.suffix_tokens,
        turns=a.turns,
        long_range=a.long_tokens,
        prompt_range=a.prompt_range,
        output_range=a.output_range,
    )


def counter(a) -> TokenCounter:
    return load_counter(a.tokenizer, a.words_per_token)


def arrival(a) -> Arrival:
    given = [x is not None for x in (a.rate, a.concurrency, a.burst_size)]
    if sum(given) > 1:
        raise SystemExit("give one of --rate, --concurrency, --burst-size")
    if a.concurrency is not None:
        return ClosedLoop(a.concurrency)
    if a.burst_size is not None:
        return Burst(a.burst_size, a.burst_interval)
    if a.rate is not None:
        return Constant(a.rate) if a.constant and not math.isinf(a.rate) else Poisson(a.rate, a.seed)
    return ClosedLoop(1)


def slo(a) -> SLO:
    return SLO(a.slo_ttft_ms, a.slo_tpot_ms, a.slo_e2e_ms)


def run_kwargs(a) -> dict:
    return {
        "max_requests": a.max_requests,
        "max_duration": a.duration,
        "max_concurrency": a.max_concurrency,
        "drain_timeout": a.drain_timeout,
        "progress": not a.no_progress,
    }


def config_dict(a, cfg: ClientConfig, wl: WorkloadConfig, arr: Arrival, tokenizer_name: str) -> dict:
    client = asdict(cfg)
    client.pop("api_key", None)
    return {
        "client": client,
        "workload": asdict(wl) | {"tokenizer": tokenizer_name},
        "arrival": arr.describe(),
        "bounds": {k: v for k, v in run_kwargs(a).items() if k != "progress"},
        "slo": asdict(slo(a)),
    }
