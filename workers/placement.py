"""Where a replica's remote ranks (1..world-1) run. Rank 0 runs inside the driver
(workers/driver_rank.py), so the first pipeline stage's ranks share the driver's node; at pp > 1
each later stage's ranks share a node, a different one for each stage where the cluster has
enough nodes (a model bigger than one node), else the nodes that fit.

Inside a Ray Serve replica started with `placement_group_bundles`, the replica's own placement
group is reused (`ray.util.get_current_placement_group()`): bundle 0 is the replica's (rank 0:
the replica reserves it with its ray_actor_options) and the remote ranks take the last world-1
bundles (Serve places them: STRICT_PACK at pp=1, PACK at pp>1, router/app.py). Otherwise
(offline `LLM`, the driver is the user's process) a new group of world-1 bundles is made, each
pinned to its stage's node with a node-id label selector; on CUDA it has a bundle 0 too, held
by a placeholder actor so Ray never hands the driver's GPU to a remote rank.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.errors import EngineDeadError

_OWN_RAY_USERS = 0  # executors using a Ray instance this process started itself


def ensure_ray(min_cpus: int) -> bool:
    """Use the Ray this process is connected to; else RAY_ADDRESS; else start a private local
    instance. True when the caller uses a Ray this process started; pair it with `release_ray()`."""
    global _OWN_RAY_USERS
    if ray.is_initialized():
        if _OWN_RAY_USERS:
            _OWN_RAY_USERS += 1
            return True
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return False
    # "local": a private instance, never a cluster someone else started with `ray start` here.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False, log_to_driver=False)
    _OWN_RAY_USERS = 1
    return True


def release_ray() -> None:
    """The last executor on a Ray this process started shuts it down."""
    global _OWN_RAY_USERS
    _OWN_RAY_USERS = max(0, _OWN_RAY_USERS - 1)
    if _OWN_RAY_USERS == 0 and ray.is_initialized():
        ray.shutdown()


def rank_resources(device_type: str, num_cpus: float) -> dict:
    return {"CPU": num_cpus, "GPU": 1} if device_type == "cuda" else {"CPU": num_cpus}


@ray.remote(num_cpus=0, num_gpus=1)
class _GpuHold:
    """Holds bundle 0's GPU for a driver that is not a Ray actor (offline LLM on CUDA)."""

    def gpu_ids(self) -> list:
        return ray.get_gpu_ids()


@dataclass
class GroupPlacement:
    pg: PlacementGroup
    bundle_indices: list[int]  # one per remote rank (ranks 1..tp-1)
    owned: bool  # we created the placement group, so we remove it
    driver_device: str | None = None  # offline CUDA: the GPU bundle 0 reserved for rank 0
    holder: object | None = None

    def strategy(self, remote_index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg,
            placement_group_bundle_index=self.bundle_indices[remote_index],
            placement_group_capture_child_tasks=False,
        )

    def release(self) -> None:
        if self.holder is not None:
            try:
                ray.kill(self.holder)
            except Exception:
                pass
        if self.owned:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass


def stage_nodes(pp: int, tp: int, per_rank: dict, driver_node: str) -> list[str]:
    """A node per pipeline stage: the driver's for stage 0; for each later stage the first node
    (in Ray's order) that no earlier stage uses and whose resources hold the stage's `tp` ranks,
    else one that still fits them beside the stages already there, else the driver's (the
    placement then waits, and fails with the cluster's resources named)."""
    totals = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    used: dict[str, dict] = {driver_node: {k: v * (tp - 1) for k, v in per_rank.items()}}
    chosen = [driver_node]
    for _ in range(1, pp):

        def fits(node: str) -> bool:
            have, taken = totals.get(node, {}), used.get(node, {})
            return all(have.get(k, 0) - taken.get(k, 0) >= v * tp for k, v in per_rank.items())

        fitting = [n for n in totals if fits(n)]
        node = next((n for n in fitting if n not in chosen), fitting[0] if fitting else driver_node)
        chosen.append(node)
        taken = used.setdefault(node, {})
        for k, v in per_rank.items():
            taken[k] = taken.get(k, 0) + v * tp
    return chosen


def place_group(
    world: int,
    device_type: str,
    num_cpus: float,
    pg: PlacementGroup | None = None,
    bundle_indices: list[int] | None = None,
    timeout_s: float = 60.0,
    tp: int | None = None,
) -> GroupPlacement:
    """Reserve (or adopt) bundles for the world-1 remote ranks: stage 0's on the driver's node,
    each later stage's on its own node (`tp`: ranks per stage; None: one stage)."""
    tp = tp or world
    n_remote = world - 1
    if pg is None:
        pg = ray.util.get_current_placement_group()
    if pg is not None:
        n = len(pg.bundle_specs)
        if bundle_indices is None:
            if n < world:
                raise ValueError(
                    f"placement group has {n} bundles, tensor_parallel_size x pipeline_parallel_size = {world} "
                    "needs as many (bundle 0 for the driver's rank 0, one per remote rank)"
                )
            bundle_indices = list(range(n - n_remote, n))
        if len(bundle_indices) != n_remote or any(not 0 <= b < n for b in bundle_indices):
            raise ValueError(
                f"bundle_indices {bundle_indices} do not name {n_remote} bundles of a {n}-bundle placement group"
            )
        placement = GroupPlacement(pg, bundle_indices, owned=False)
    else:
        node = ray.get_runtime_context().get_node_id()
        per_rank = rank_resources(device_type, num_cpus)
        nodes = stage_nodes(world // tp, tp, per_rank, node)
        bundles = [per_rank] * n_remote
        selectors = [{"ray.io/node-id": nodes[r // tp]} for r in range(1, world)]
        if device_type == "cuda":
            bundles = [{"GPU": 1}] + bundles
            selectors = [{"ray.io/node-id": node}] + selectors
        pg = placement_group(
            bundles,
            strategy="STRICT_PACK" if world == tp else "PACK",
            name=f"orbital-tp{tp}-pp{world // tp}-{uuid.uuid4().hex[:8]}",
            bundle_label_selector=selectors,
        )
        first = 1 if device_type == "cuda" else 0
        placement = GroupPlacement(pg, list(range(first, first + n_remote)), owned=True)
    ready, _ = ray.wait([placement.pg.ready()], timeout=timeout_s)
    if not ready:
        placement.release()
        raise EngineDeadError(
            f"cannot place the {n_remote} remote rank(s) of a replica of {world // tp} stage(s) x {tp} rank(s) "
            f"within {timeout_s:.0f}s: each needs {rank_resources(device_type, num_cpus)} on its stage's node "
            f"(cluster resources: {ray.available_resources()})"
        )
    if placement.owned and device_type == "cuda":
        _hold_driver_gpu(placement)
    return placement


def _hold_driver_gpu(placement: GroupPlacement) -> None:
    """Reserve bundle 0's GPU with a placeholder actor; rank 0 in the driver uses that GPU."""
    placement.holder = _GpuHold.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=placement.pg, placement_group_bundle_index=0
        )
    ).remote()
    gpu = str(ray.get(placement.holder.gpu_ids.remote(), timeout=60)[0])
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    placement.driver_device = f"cuda:{visible.index(gpu) if visible else gpu}"
