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
    head = f"{'':12} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}"
    lines += ["", head]
    for key, name in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("itl_ms", "ITL ms"), ("e2e_ms", "E2E ms")):
        s = a[key]
        lines.append(f"{name:12} " + " ".join(f"{_fmt(s[k]):>9}" for k in ("mean", "p50", "p90", "p99", "max")))
    return "\n".join(lines)
