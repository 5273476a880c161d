"""What the ingress gathers from every engine replica of every pool (`PoolReports`, a base of the
`Ingress` deployment, so these are Python handle methods too): health (/health), stats
(`replica_stats`, /metrics) and the cluster's state (/cluster/state, the web page's panel). Each
is one call per replica, pinned to it (router/replica_choice/), under `control_timeout_s`.
"""

from __future__ import annotations

import asyncio

from router.config import AppConfig
from router.ingress.cluster_state import pool_state
from router.ingress.model_pools import ModelPools, PoolClient, SidePool
from router.metrics import render_pools
from router.replica_choice.routing_state import routing_state


def _health_of(pool: PoolClient | SidePool, results: list[tuple[str, object]]) -> dict:
    """A pool's /health entry from its replicas' health check answers (an exception: failed)."""
    bad = [r for r, v in results if isinstance(v, BaseException)]
    ok = len(results) >= pool.expected_replicas and not bad
    return {
        "status": "ok" if ok else "unavailable",
        "replicas": len(results),
        "expected_replicas": pool.expected_replicas,
        "unhealthy": bad,
    }


class PoolReports:
    """Methods over the attributes `Ingress.__init__` sets."""

    settings: AppConfig
    pools: ModelPools
    prefill: SidePool | None  # a disaggregated app's prefill pool
    app_name: str

    async def _replicas(self, pool: PoolClient | SidePool) -> list[str]:
        name = pool.handle.deployment_name
        ids = [r for r, _ in routing_state().known_replicas(self.app_name, name)]
        if not ids:  # the handle's router starts on first use
            try:
                await asyncio.wait_for(pool.handle.stats.remote(), self.settings.control_timeout_s)
            except Exception:  # noqa: BLE001
                pass
            ids = [r for r, _ in routing_state().known_replicas(self.app_name, name)]
        return ids

    async def _fan_out(self, pool: PoolClient | SidePool, method: str) -> list[tuple[str, object]]:
        ids = await self._replicas(pool)

        async def one(rid: str):
            try:
                call = getattr(pool.handle, method).remote(replica_id=rid)
                return rid, await asyncio.wait_for(call, self.settings.control_timeout_s)
            except Exception as e:  # noqa: BLE001
                return rid, e

        return list(await asyncio.gather(*(one(r) for r in ids)))

    async def _pool_health(self, pool: PoolClient | SidePool) -> dict:
        return _health_of(pool, await self._fan_out(pool, "check_health"))

    async def health(self) -> dict:
        """ok only when every pool has its expected replicas up and answering; the top-level
        counts are the pools' sums, `pools` has each pool's own."""
        pools = list(self.pools) + ([self.prefill] if self.prefill is not None else [])
        each = await asyncio.gather(*(self._pool_health(p) for p in pools))
        return {
            "status": "ok" if all(h["status"] == "ok" for h in each) else "unavailable",
            "replicas": sum(h["replicas"] for h in each),
            "expected_replicas": sum(h["expected_replicas"] for h in each),
            "unhealthy": [r for h in each for r in h["unhealthy"]],
            "pools": {p.name: h for p, h in zip(pools, each)},
        }

    async def replica_stats(self, pool: str | None = None) -> list[dict]:
        """Each engine replica's stats for one pool (None: the first; "prefill": a disaggregated
        app's prefill pool)."""
        if pool == "prefill" and self.prefill is not None:
            return await self._stats(self.prefill)
        return await self._stats(self.pools.get(pool))

    async def _stats(self, pool: PoolClient | SidePool) -> list[dict]:
        return [v for _, v in await self._fan_out(pool, "stats") if isinstance(v, dict)]

    async def cluster_state(self) -> dict:
        """/cluster/state (the web page's state panel): per pool, each replica's health check and
        stats, the pool's totals, and this router replica's queue and routing counts
        (router/ingress/cluster_state.py)."""
        watched: list[tuple[PoolClient | SidePool, str | None, dict | None]] = [
            (p, None, p.client.stats()) for p in self.pools
        ]
        if self.prefill is not None:  # a disaggregated app: requests go to the decode pool
            watched[0] = (watched[0][0], "decode", watched[0][2])
            watched.append((self.prefill, "prefill", None))

        async def one(pool: PoolClient | SidePool) -> tuple[list, list]:
            return await asyncio.gather(self._fan_out(pool, "check_health"), self._fan_out(pool, "stats"))

        answers = await asyncio.gather(*(one(p) for p, _, _ in watched))
        routing = routing_state().log.stats()["per_replica"]
        pools = [
            pool_state(p.name, role, _health_of(p, checks), checks, stats, router, routing)
            for (p, role, router), (checks, stats) in zip(watched, answers)
        ]
        return {"status": "ok" if all(p["status"] == "ok" for p in pools) else "unavailable", "pools": pools}

    async def metrics(self) -> bytes:
        """The /metrics page: every pool's replicas' stats, this router replica's queues, tier
        overflows and routing counts (router/metrics.py)."""
        pools = list(self.pools)
        stats = await asyncio.gather(*(self._stats(p) for p in pools))
        page = [(p.name, s, p.client.stats()) for p, s in zip(pools, stats)]

        roles = None
        if self.prefill is not None:  # per-pool series of a disaggregated app
            roles = {"decode": stats[0], "prefill": await self._stats(self.prefill)}
        return render_pools(page, self.pools.overflows, routing_state().log.stats(), roles, self.pools.decisions)
