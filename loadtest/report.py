"""The terminal summary of one result."""

from __future__ import annotations


def _fmt(v, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def slo_text(slo: dict) -> str:
    parts = [
        f"{name.upper()}<={slo[key]:g}ms"
        for key, name in (("ttft_ms", "ttft"), ("tpot_ms", "tpot"), ("e2e_ms", "e2e"))
        if slo.get(key) is not None
    ]
    return " ".join(parts) or "no SLO given (every success counts)"


def summary(result: dict) -> str:
    a = result["aggregates"]
    cfg = result.get("config", {})
    errs = ", ".join(f"{k}={v}" for k, v in a["errors_by_kind"].items())
    lines = [
        f"== {result.get('label')} : {result.get('model')} @ {cfg.get('client', {}).get('base_url', '?')}",
        f"workload     {cfg.get('workload', {}).get('name', '?')}  arrival {cfg.get('arrival', {})}",
        f"requests     {a['requests']} ({a['succeeded']} ok, {a['failed']} failed{': ' + errs if errs else ''})"
        + (f", {a['not_sent']} not sent (duration bound)" if a.get("not_sent") else ""),
        f"duration     {_fmt(a['duration_s'], 2)} s",
        f"throughput   {_fmt(a['req_s'], 2)} req/s | output {_fmt(a['output_tok_s'])} tok/s | "
        f"total {_fmt(a['total_tok_s'])} tok/s",
        f"tokens       prompt {_fmt(a['prompt_tokens'])} | output {_fmt(a['output_tokens'])} "
        f"(server usage on {a['usage_reported']}/{a['succeeded']})",
        f"goodput      {100 * a['goodput']['share']:.1f}% of requests, {_fmt(a['goodput']['req_s'], 2)} req/s "
        f"({slo_text(a['goodput']['slo'])})",
    ]
    if a.get("prefix_cache"):
        pc = a["prefix_cache"]
        lines.append(f"prefix cache {100 * pc['hit_rate']:.1f}% of prompt tokens cached (server usage)")
    sm = result.get("server_metrics") or {}
    if sm.get("prefix_cache_hit_rate") is not None:
        lines.append(f"prefix cache {100 * sm['prefix_cache_hit_rate']:.1f}% hit rate (server /metrics)")
    cols = ("mean", "p50", "p90", "p95", "p99", "max")
    lines += ["", f"{'':12} " + " ".join(f"{c:>9}" for c in cols)]
    for key, name in (
        ("ttft_ms", "TTFT ms"),
        ("tpot_ms", "TPOT ms"),
        ("itl_ms", "ITL ms"),
        ("e2e_ms", "E2E ms"),
        ("request_tok_s", "req tok/s"),
    ):
        s = a.get(key)
        if s:
            lines.append(f"{name:12} " + " ".join(f"{_fmt(s.get(k)):>9}" for k in cols))
    series = result.get("server_series")
    if series and series.get("t"):
        lines += ["", f"server ({len(series['t'])} samples, every {series['interval_s']:g} s)   mean       max"]
        for key, name in SERVER_SERIES_NAMES.items():
            vals = [v for v in series.get(key, []) if v is not None]
            if vals:
                lines.append(f"  {name:28} {_fmt(sum(vals) / len(vals), 2):>9} {_fmt(max(vals), 2):>9}")
    return "\n".join(lines)


SERVER_SERIES_NAMES = {
    "num_running": "running batch (requests)",
    "num_waiting": "queue depth (requests)",
    "kv_cache_usage": "KV cache usage (0..1)",
    "preemptions": "preemptions (since start)",
    "prefix_hit_rate": "prefix hit rate (interval)",
}
