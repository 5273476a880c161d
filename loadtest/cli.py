"""``python -m loadtest run|sweep|compare|plot|workload``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from loadtest import options as O
from loadtest import plots, report, workloads
from loadtest.compare import render, table
from loadtest.result import KIND, SWEEP_KIND, load, save
from loadtest.sweep import load_sweep, measure, sweep, sweep_table


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="one load test; summary, result JSON, optional plots")
    O.add_server(r), O.add_workload(r), O.add_arrival(r), O.add_slo_output(r)
    r.add_argument("--out", default=None, help="result JSON (default loadtest-results/<label>.json)")
    r.add_argument("--plots", default=None, help="directory for PNG plots")

    s = sub.add_parser("sweep", help="the same workload at several concurrencies or rates")
    O.add_server(s), O.add_workload(s), O.add_arrival(s, sweepable=True), O.add_slo_output(s)
    s.add_argument("--over", choices=("concurrency", "rate"), default="concurrency")
    s.add_argument("--values", default="1,2,4,8,16,32,64", help="comma-separated")
    s.add_argument(
        "--requests-per-unit", type=int, default=0, help="send max(--num-requests, this x value) requests per point"
    )
    s.add_argument("--out-dir", default="loadtest-results/sweep")

    c = sub.add_parser("compare", help="result files side by side with ratios to the first")
    c.add_argument("files", nargs="+")
    c.add_argument("--markdown", action="store_true")
    c.add_argument("--out", default=None, help="write the comparison as JSON")
    c.add_argument("--plots", default=None, help="directory for overlaid CDF/throughput PNGs")

    pl = sub.add_parser("plot", help="PNG plots of result files or a sweep.json")
    pl.add_argument("files", nargs="+")
    pl.add_argument("--out-dir", default="loadtest-results/plots")

    w = sub.add_parser("workload", help="generate a workload and write it as JSONL")
    O.add_workload(w)
    w.add_argument("--out", default="-", help="JSONL path ('-': stdout)")
    return p


def _specs(a):
    wl = O.workload_config(a)
    counter = O.counter(a)
    return wl, counter, workloads.build(wl, counter)


def cmd_run(a) -> int:
    cfg, arr = O.client_config(a), O.arrival(a)
    wl, counter, specs = _specs(a)
    config = O.config_dict(a, cfg, wl, arr, counter.name)
    res = measure(
        specs,
        cfg,
        arr,
        O.slo(a),
        config,
        label=a.label,
        scrape=a.scrape_metrics,
        series_interval_s=a.metrics_interval_s,
        **O.run_kwargs(a),
    )
    out = a.out or os.path.join("loadtest-results", f"{res['label'].replace(' ', '_')}.json")
    save(res, out)
    print(report.summary(res))
    print(f"\nresult: {out}")
    if a.plots:
        for path in plots.plot_results([res], a.plots):
            print(f"plot:   {path}")
    return 0 if res["aggregates"]["succeeded"] else 1


def cmd_sweep(a) -> int:
    cfg = O.client_config(a)
    wl, counter = O.workload_config(a), O.counter(a)
    values = [float(v) for v in a.values.split(",") if v.strip()]
    cache: dict[int, list] = {}

    def specs_for(v: float):
        n = max(a.num_requests, int(a.requests_per_unit * v))
        if n not in cache:
            wl.num_requests = n
            cache[n] = workloads.build(wl, counter)
        return cache[n]

    config = _sweep_config(a, cfg, wl, counter.name)
    res = sweep(
        specs_for,
        cfg,
        a.over,
        values,
        O.slo(a),
        config,
        a.out_dir,
        seed=a.seed,
        label=a.label or f"{wl.name} sweep",
        scrape=a.scrape_metrics,
        series_interval_s=a.metrics_interval_s,
        **O.run_kwargs(a),
    )
    print(sweep_table(res, markdown=False))
    print(f"\nsweep: {os.path.join(a.out_dir, 'sweep.json')}")
    print(f"plot:  {plots.sweep_plot(res, os.path.join(a.out_dir, 'sweep.png'))}")
    return 0


def _sweep_config(a, cfg, wl, tokenizer_name: str) -> dict:
    config = O.config_dict(a, cfg, wl, O.ClosedLoop(1), tokenizer_name)  # arrival: set per point
    return config | {"sweep": {"over": a.over, "values": a.values, "requests_per_unit": a.requests_per_unit}}


def cmd_compare(a) -> int:
    results = [load(f) for f in a.files]
    for f, res in zip(a.files, results):
        res.setdefault("label", os.path.basename(f))
    print(render(results, markdown=a.markdown))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(table(results), f, indent=1)
    if a.plots:
        for path in plots.plot_results(results, a.plots, prefix="compare_"):
            print(f"plot: {path}")
    return 0


def cmd_plot(a) -> int:
    results = []
    for f in a.files:
        with open(f) as fh:
            kind = json.load(fh).get("kind")
        if kind == SWEEP_KIND:
            print(plots.sweep_plot(load_sweep(f), os.path.join(a.out_dir, "sweep.png")))
        elif kind == KIND:
            results.append(load(f))
        else:
            raise SystemExit(f"{f}: not a loadtest result or sweep file")
    if results:
        for path in plots.plot_results(results, a.out_dir):
            print(path)
    return 0


def cmd_workload(a) -> int:
    _, _, specs = _specs(a)
    text = workloads.dumps(specs)
    if a.out == "-":
        sys.stdout.write(text)
    else:
        with open(a.out, "w") as f:
            f.write(text)
        print(f"{len(specs)} requests -> {a.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    return {"run": cmd_run, "sweep": cmd_sweep, "compare": cmd_compare, "plot": cmd_plot, "workload": cmd_workload}[
        a.cmd
    ](a)
