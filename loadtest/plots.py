"""PNG plots: latency CDFs, throughput over time, and TTFT/TPOT/throughput against load."""

from __future__ import annotations

import os

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.metrics import auto_bin, concurrency_series, throughput_series  # noqa: E402
from loadtest.result import records_of  # noqa: E402


def _cdf(ax, values_s, label):
    if not values_s:
        return
    x = np.sort(np.asarray(values_s) * 1e3)
    ax.plot(x, np.arange(1, x.size + 1) / x.size, label=label)


def latency_cdfs(results: list[dict], path: str) -> str:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for res in results:
        ok = [r for r in records_of(res) if r.success]
        label = res.get("label", "run")
        _cdf(axes[0], [r.ttft for r in ok if r.ttft is not None], label)
        _cdf(axes[1], [r.tpot for r in ok if r.tpot is not None], label)
        _cdf(axes[2], [r.latency for r in ok if r.latency is not None], label)
    for ax, name in zip(axes, ("TTFT", "TPOT", "end-to-end latency")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    return _save(fig, path)


def _step(ax, t, y, bin_s, label):
    if len(t):
        ax.step(np.append(t, t[-1] + bin_s), np.append(y, y[-1]), where="post", label=label)


def throughput_over_time(results: list[dict], path: str, bin_s: float | None = None) -> str:
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    all_recs = [records_of(res) for res in results]
    bin_s = bin_s or max(auto_bin(recs) for recs in all_recs)
    for res, recs in zip(results, all_recs):
        label = res.get("label", "run")
        _step(ax1, *throughput_series(recs, bin_s), bin_s, label)
        _step(ax2, *concurrency_series(recs, bin_s), bin_s, label)
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(f"throughput over time ({bin_s:g} s bins)")
    ax2.set_ylabel("requests in flight (mean)")
    ax2.set_xlabel("time since start (s)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    return _save(fig, path)


def sweep_plot(sweep: dict, path: str) -> str:
    pts = sweep["points"]
    x = [p["load"] for p in pts]
    xlabel = "concurrency" if sweep.get("over") == "concurrency" else "offered rate (req/s)"
    agg = [p["aggregates"] for p in pts]

    def col(key, sub):
        return [np.nan if a[key][sub] is None else a[key][sub] for a in agg]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for sub in ("p50", "p90", "p95", "p99"):
        axes[0].plot(x, col("ttft_ms", sub), marker="o", label=f"TTFT {sub}")
        axes[1].plot(x, col("tpot_ms", sub), marker="o", label=f"TPOT {sub}")
    axes[2].plot(x, [a["output_tok_s"] for a in agg], marker="o", label="output tok/s")
    ax3 = axes[2].twinx()
    ax3.plot(x, [a["goodput"]["req_s"] for a in agg], marker="s", color="tab:red", label="goodput req/s")
    ax3.set_ylabel("goodput (req/s)")
    for ax, title in zip(axes, ("TTFT vs load (ms)", "TPOT vs load (ms)", "throughput vs load")):
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(set(x)) > 1 and min(x) > 0 and max(x) / min(x) >= 8:
            ax.set_xscale("log", base=2)
            ax.set_xticks(x)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=8, loc="upper left")
    ax3.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def server_over_time(results: list[dict], path: str) -> str:
    """The server's own figures scraped during each run (servermetrics.SeriesPoller)."""
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for res in results:
        s, label = res.get("server_series") or {}, res.get("label", "run")
        if not s.get("t"):
            continue
        t = np.asarray(s["t"])

        def line(ax, key, name):
            y = np.asarray([np.nan if v is None else v for v in s.get(key, [])], dtype=float)
            if len(y) == len(t) and not np.all(np.isnan(y)):
                ax.plot(t, y, marker=".", label=f"{label}: {name}")

        line(axes[0], "num_running", "running batch")
        line(axes[0], "num_waiting", "queue depth")
        line(axes[1], "kv_cache_usage", "KV cache usage")
        line(axes[1], "prefix_hit_rate", "prefix hit rate")
        line(axes[2], "preemptions", "preemptions")
    axes[0].set_ylabel("requests")
    axes[1].set_ylabel("fraction")
    axes[2].set_ylabel("since start")
    axes[2].set_xlabel("time since start (s)")
    axes[0].set_title("server figures during the run (/metrics)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    return _save(fig, path)


def plot_results(results: list[dict], out_dir: str, prefix: str = "") -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [
        latency_cdfs(results, os.path.join(out_dir, f"{prefix}latency_cdf.png")),
        throughput_over_time(results, os.path.join(out_dir, f"{prefix}throughput.png")),
    ]
    if any((r.get("server_series") or {}).get("t") for r in results):
        paths.append(server_over_time(results, os.path.join(out_dir, f"{prefix}server.png")))
    return paths


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
