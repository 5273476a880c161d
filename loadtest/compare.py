"""Two or more results side by side, with each one's ratio to the first (the baseline)."""

from __future__ import annotations

ROWS = [  # (label, getter path, higher is better)
    ("requests ok", ("succeeded",), True),
    ("requests failed", ("failed",), False),
    ("req/s", ("req_s",), True),
    ("output tok/s", ("output_tok_s",), True),
    ("total tok/s", ("total_tok_s",), True),
    ("goodput share", ("goodput", "share"), True),
    ("goodput req/s", ("goodput", "req_s"), True),
    ("TTFT p50 ms", ("ttft_ms", "p50"), False),
    ("TTFT p90 ms", ("ttft_ms", "p90"), False),
    ("TTFT p95 ms", ("ttft_ms", "p95"), False),
    ("TTFT p99 ms", ("ttft_ms", "p99"), False),
    ("TPOT p50 ms", ("tpot_ms", "p50"), False),
    ("TPOT p90 ms", ("tpot_ms", "p90"), False),
    ("TPOT p95 ms", ("tpot_ms", "p95"), False),
    ("TPOT p99 ms", ("tpot_ms", "p99"), False),
    ("ITL p50 ms", ("itl_ms", "p50"), False),
    ("ITL p95 ms", ("itl_ms", "p95"), False),
    ("ITL p99 ms", ("itl_ms", "p99"), False),
    ("E2E p50 ms", ("e2e_ms", "p50"), False),
    ("E2E p95 ms", ("e2e_ms", "p95"), False),
    ("E2E p99 ms", ("e2e_ms", "p99"), False),
    ("prefix hit rate", ("prefix_cache", "hit_rate"), True),
]


def _get(agg: dict, path: tuple[str, ...]):
    v = agg
    for k in path:
        if not isinstance(v, dict):
            return None
        v = v.get(k)
    return v


def hit_rate(result: dict):
    """Prefix-cache hit rate: the server's /metrics counters if scraped, else usage cached_tokens."""
    sm = result.get("server_metrics") or {}
    if sm.get("prefix_cache_hit_rate") is not None:
        return sm["prefix_cache_hit_rate"]
    return _get(result["aggregates"], ("prefix_cache", "hit_rate"))


def table(results: list[dict]) -> dict:
    """{"labels": [...], "rows": [{"metric", "values", "ratios", "higher_is_better"}]}."""
    labels = [r.get("label", f"run{i}") for i, r in enumerate(results)]
    rows = []
    for name, path, better in ROWS:
        if path[0] == "prefix_cache":
            values = [hit_rate(r) for r in results]
        else:
            values = [_get(r["aggregates"], path) for r in results]
        if all(v is None for v in values):
            continue
        base = values[0]
        ratios = [None if (v is None or not base) else v / base for v in values]
        rows.append({"metric": name, "values": values, "ratios": ratios, "higher_is_better": better})
    return {"labels": labels, "rows": rows}


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and abs(v) < 10 and v != int(v):
        return f"{v:.3f}"
    return f"{v:,.1f}" if isinstance(v, float) else f"{v:,}"


def render(results: list[dict], markdown: bool = False) -> str:
    t = table(results)
    labels = t["labels"]
    head = ["metric"] + labels + [f"{lab} / {labels[0]}" for lab in labels[1:]]
    body = [
        [row["metric"]]
        + [_num(v) for v in row["values"]]
        + ["-" if r is None else f"{r:.2f}x" for r in row["ratios"][1:]]
        for row in t["rows"]
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)
    widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in body])
