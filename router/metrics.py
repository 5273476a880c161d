"""Prometheus metrics: engine replicas keep counters and latency histograms as plain numbers,
the router sums them over replicas and renders one Prometheus text page (names as in vLLM,
`orbital:` prefix, a `model_name` label).

Histograms live in the engine replicas (they see every token as it is produced), so the page
is the same whichever router replica serves `/metrics` and however many engine replicas there
are. The router adds only what it alone knows (rejections, requests in flight at the router).
With several model pools (`render_pools`) each pool's series carry its own `model_name`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from router.histogram import Histogram

# Bucket bounds as vLLM uses them.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

HISTOGRAMS = {
    "time_to_first_token_seconds": (TTFT_BUCKETS, "Time to first token (from router arrival)."),
    "inter_token_latency_seconds": (ITL_BUCKETS, "Time between consecutive output tokens."),
    "e2e_request_latency_seconds": (REQUEST_BUCKETS, "End-to-end request latency (from router arrival)."),
    "request_queue_time_seconds": (REQUEST_BUCKETS, "Time a request waited before it was first scheduled."),
    # Disaggregated serving, decode replicas: fetching + writing a prefill's KV, and the whole
    # remote prefill (asking the prefill pool, its compute, the transfer).
    "kv_transfer_seconds": (TTFT_BUCKETS, "Time to move one prefill's KV blocks into a decode replica."),
    "remote_prefill_seconds": (TTFT_BUCKETS, "Time from asking the prefill pool to the KV written (decode side)."),
    # Fetches from a peer (router/replica/peer_fetch.py): asking the holder to the KV handed over.
    "kv_peer_fetch_seconds": (TTFT_BUCKETS, "Time to fetch a prompt's prefix from the replica holding it."),
}
# Fetches of a prompt's prefix from the replica holding it (router/replica/peer_fetch.py), from
# every engine replica's stats: stats key -> help. Part of COUNTERS.
KV_PEER_COUNTERS = {
    "kv_peer_fetches": "Prompt prefixes fetched from the replica holding them instead of recomputed.",
    "kv_peer_fetch_failures": "Fetches from a peer that failed (holder gone, blocks evicted, timeout): recomputed.",
    "kv_peer_fetch_bytes": "KV bytes fetched from peers.",
    "kv_peer_tokens_fetched": "Prompt tokens whose KV was fetched from a peer: recomputes avoided.",
    "kv_peer_exports": "Prompt prefixes this pool's replicas read out of their prefix cache for a peer.",
}
COUNTERS = {
    "prompt_tokens": "Prompt tokens processed.",
    "generation_tokens": "Generation tokens produced.",
    "prefix_cache_queries": "Prefix cache queries, in tokens.",
    "prefix_cache_hits": "Prefix cache hits, in tokens (every tier).",
    "prefix_cache_hits_offload": "Prefix cache hits loaded from the offload tier (part of prefix_cache_hits), in tokens.",
    "offload_blocks_saved": "KV blocks saved to the offload tier when evicted from the pool.",
    "offload_blocks_loaded": "KV blocks loaded back from the offload tier on a prefix hit.",
    "offload_load_failures": "Offload tier loads that failed (file damaged or gone): recomputed.",
    "num_preemptions": "Requests preempted by the scheduler.",
    "num_request_faults": "Requests failed alone because their engine step raised (the engine went on).",
    **KV_PEER_COUNTERS,
}
# Speculative decoding, named as vLLM's: metric name -> (engine stats key, help).
SPEC_COUNTERS = {
    "spec_decode_num_drafts": ("spec_num_drafts", "Verifications of draft tokens (speculative decoding)."),
    "spec_decode_num_draft_tokens": ("spec_num_draft_tokens", "Draft tokens proposed and verified."),
    "spec_decode_num_accepted_tokens": ("spec_num_accepted_tokens", "Draft tokens accepted."),
}
# Disaggregated serving, from the decode replicas' stats: stats key -> help.
KV_TRANSFER_COUNTERS = {
    "kv_transfers": "KV hand-offs from the prefill pool completed (decode side).",
    "kv_transfer_blocks": "KV blocks moved from the prefill pool.",
    "kv_transfer_bytes": "KV bytes moved from the prefill pool.",
    "kv_transfer_failures": "Remote prefills or KV transfers that failed (recomputed or failed per policy).",
    "num_remote_prefills": "Prompts the decode replicas asked the prefill pool for.",
    "num_local_prefills": "Prompts the decode replicas prefilled themselves (short uncached suffix).",
}


def new_histograms() -> dict[str, Histogram]:
    return {name: Histogram(bounds) for name, (bounds, _) in HISTOGRAMS.items()}


class _Snapshot:
    """A prometheus_client collector over one already-aggregated snapshot."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return iter(self.families)


def aggregate(replica_stats: list[dict]) -> dict:
    """Sum the engine replicas' stats (gauges, counters, histogram buckets)."""
    hist = new_histograms()
    agg = {
        "num_running": 0,
        "num_waiting": 0,
        "blocks_used": 0,
        "num_blocks": 0,
        "kv_capacity_tokens": 0,
        "finished": {},
        "rejected": 0,
        **{k: 0 for k in COUNTERS},
        **{k: 0 for k, _ in SPEC_COUNTERS.values()},
    }
    for s in replica_stats:
        for k in ("num_running", "num_waiting", "blocks_used", "num_blocks", "kv_capacity_tokens", *COUNTERS):
            agg[k] += s.get(k, 0)
        for k, _ in SPEC_COUNTERS.values():
            agg[k] += s.get(k, 0)
        agg["rejected"] += s.get("queue", {}).get("rejected", 0)
        for reason, n in s.get("finished", {}).items():
            agg["finished"][reason] = agg["finished"].get(reason, 0) + n
        for name, d in s.get("histograms", {}).items():
            if name in hist:
                hist[name].merge(d)
    agg["kv_cache_usage"] = agg["blocks_used"] / agg["num_blocks"] if agg["num_blocks"] else 0.0
    agg["histograms"] = hist
    return agg


ROUTING_COUNTERS = {
    "routed": "Requests this router sent to the engine replica.",
    "predicted_cached_tokens": "Prompt tokens the router predicted cached on the replica it chose (cache-aware).",
    "actual_cached_tokens": "Prompt tokens the engine replica reported as prefix-cache hits for those requests, in whole blocks.",
    "peer_fetches_planned": "Requests sent to the engine replica with a hint to fetch their prefix from another one.",
}


def render(model_name: str, replica_stats: list[dict], router: dict) -> bytes:
    """Prometheus text exposition of the aggregated stats plus the router's own numbers."""
    return render_pools([(model_name, replica_stats, router)])


def render_pools(
    pools: list[tuple[str, list[dict], dict]],
    tier_overflows: dict[tuple[str, str, str, str], int] | None = None,
    routing: dict | None = None,
    roles: dict[str, list[dict]] | None = None,
    tier_decisions: dict[tuple[str, str, str], int] | None = None,
) -> bytes:
    """One page for several model pools: `pools` is (model name, its engine replicas' stats, its
        router queue's stats) per pool; every series carries its pool's `model_name`, and each family
        has one HELP/TYPE line. `tier_overflows`: (alias, from pool, to pool, cause) -> requests moved
    on; `tier_decisions`: (alias, pool, reason) -> requests that started at that pool.
        `routing`: this router replica's `routing_state().log.stats()` (per engine replica decisions).
        `roles` (a disaggregated app): pool role ("prefill", "decode") -> its replicas' stats, for
        the per-pool series and the KV transfer counters."""
    fams: dict[str, object] = {}

    def family(kind, name: str, doc: str, labels: tuple[str, ...] = ("model_name",)):
        if name not in fams:
            fams[name] = kind(f"orbital:{name}", doc, labels=list(labels))
        return fams[name]

    for model_name, replica_stats, router in pools:
        agg = aggregate(replica_stats)
        lv = [model_name]

        def gauge(name: str, doc: str, value: float) -> None:
            family(GaugeMetricFamily, name, doc).add_metric(lv, value)

        def counter(name: str, doc: str, value: float) -> None:
            family(CounterMetricFamily, name, doc).add_metric(lv, value)

        gauge("num_requests_running", "Requests in the engines' running batches.", agg["num_running"])
        gauge("num_requests_waiting", "Requests waiting in the engines' queues.", agg["num_waiting"])
        gauge("kv_cache_usage_perc", "KV cache usage (1 = full), over all replicas.", agg["kv_cache_usage"])
        gauge(
            "kv_cache_capacity_tokens",
            "Tokens the engines' KV pools hold (int8 KV: about twice bfloat16's), over all replicas.",
            agg["kv_capacity_tokens"],
        )
        gauge("num_replicas", "Engine replicas the router knows.", len(replica_stats))
        gauge("router_requests_in_flight", "Requests in this router replica.", router.get("in_flight", 0))
        gauge("router_requests_queued", "Requests in this router replica with no token yet.", router.get("queued", 0))
        for name, doc in COUNTERS.items():
            counter(name, doc, agg[name])
        for name, (key, doc) in SPEC_COUNTERS.items():
            counter(name, doc, agg[key])
        drafted = agg["spec_num_draft_tokens"]
        gauge(
            "spec_decode_acceptance_rate",
            "Accepted / proposed draft tokens since start, over all replicas.",
            agg["spec_num_accepted_tokens"] / drafted if drafted else 0.0,
        )
        # Failover (router/ingress/failover.py): requests moved off a dead or drained replica.
        counter(
            "router_migrations", "Requests moved to another engine replica mid-request.", router.get("migrations", 0)
        )
        counter(
            "router_migration_failures",
            "Requests whose replica failed and that could not move (max_migrations).",
            router.get("migration_failures", 0),
        )
        # Output channels (router/channel_socket.py): engine-step messages by the way they came.
        counter(
            "router_output_socket_messages",
            "Engine-step output messages read from this router's local socket (replicas on its node).",
            router.get("channel_socket_messages", 0),
        )
        counter(
            "router_output_call_messages",
            "Engine-step output messages that came over Ray streaming calls (replicas on other nodes).",
            router.get("channel_call_messages", 0),
        )
        counter(
            "num_requests_rejected",
            "Requests rejected with 429 (overload), router and replicas.",
            router.get("rejected", 0) + agg["rejected"],
        )
        success = family(
            CounterMetricFamily,
            "request_success",
            "Finished requests by finish reason.",
            ("model_name", "finished_reason"),
        )
        for reason in sorted(set(agg["finished"]) | {"stop", "length", "abort"}):
            success.add_metric([model_name, reason], agg["finished"].get(reason, 0))
        for name, (bounds, doc) in HISTOGRAMS.items():
            h = agg["histograms"][name]
            cum, buckets = 0, []
            for bound, c in zip(list(bounds) + [float("inf")], h.counts):
                cum += c
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
            family(HistogramMetricFamily, name, doc).add_metric(lv, buckets, h.total)
        per_replica = (routing or {}).get("per_replica", {})
        for s in replica_stats:
            c = per_replica.get(s.get("replica_id"))
            if c is None:
                continue
            labels = ("model_name", "replica")
            for key, doc in ROUTING_COUNTERS.items():
                family(CounterMetricFamily, f"router_{key}", doc, labels).add_metric(
                    [model_name, s["replica_id"]], c[key]
                )
    if roles:
        _render_roles(family, pools[0][0], roles)
    if routing is not None:
        decisions = family(
            CounterMetricFamily, "router_decision_seconds", "CPU time of this router's replica choices.", ()
        )
        decisions.add_metric([], routing["decision_seconds"])
        family(CounterMetricFamily, "router_decisions", "Replica choices timed (cache-aware).", ()).add_metric(
            [], routing["decisions"]
        )
    if tier_overflows:
        moved = family(
            CounterMetricFamily,
            "tier_overflows",
            "Requests for an alias that moved from one pool of its tier to the next: the first shed load "
            "(cause=overload) or its replica failed before the first output (cause=error).",
            ("alias", "from_pool", "to_pool", "cause"),
        )
        for (alias, src, dst, cause), n in sorted(tier_overflows.items()):
            moved.add_metric([alias, src, dst, cause], n)
    if tier_decisions:
        picked = family(
            CounterMetricFamily,
            "tier_decisions",
            "Requests for an alias by the pool they started at and what chose it (hint, rule, classifier, default).",
            ("alias", "pool", "reason"),
        )
        for (alias, pool, reason), n in sorted(tier_decisions.items()):
            picked.add_metric([alias, pool, reason], n)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(list(fams.values())))
    return generate_latest(registry)


def _render_roles(family, model_name: str, roles: dict[str, list[dict]]) -> None:
    """Per-pool series of a disaggregated app (`pool` label) and the decode side's transfers."""
    labels = ("model_name", "pool")
    for role, stats in roles.items():
        agg = aggregate(stats)
        lv = [model_name, role]
        for name, doc, value in (
            ("pool_num_replicas", "Replicas of the pool the router reached.", len(stats)),
            ("pool_num_requests_running", "Sequences in the pool's running batches.", agg["num_running"]),
            ("pool_num_requests_waiting", "Sequences waiting in the pool's queues.", agg["num_waiting"]),
            ("pool_kv_cache_usage_perc", "KV cache usage of the pool (1 = full).", agg["kv_cache_usage"]),
        ):
            family(GaugeMetricFamily, name, doc, labels).add_metric(lv, value)
        family(CounterMetricFamily, "pool_prompt_tokens", "Prompt tokens the pool received.", labels).add_metric(
            lv, agg["prompt_tokens"]
        )
    decode = roles.get("decode", [])
    for key, doc in KV_TRANSFER_COUNTERS.items():
        family(CounterMetricFamily, key, doc).add_metric([model_name], sum(s.get(key, 0) for s in decode))
