"""Where a tensor-parallel group's actors run: a STRICT_PACK placement group (one node),
one bundle per rank ({"GPU": 1} on CUDA, CPUs otherwise).

Inside a Ray Serve replica started with `placement_group_bundles`, the replica's own
placement group is reused (`ray.util.get_current_placement_group()`); the ranks take the
last `tp` bundles (bundle 0 is the replica's when there are tp + 1).
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
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False,
             log_to_driver=False)
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


@dataclass
class GroupPlacement:
    pg: PlacementGroup
    bundle_indices: list[int]
    owned: bool  # we created the placement group, so we remove it

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self.bundle_indices[rank],
            placement_group_capture_child_tasks=False)

    def release(self) -> None:
        if self.owned:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass


def place_group(tp: int, device_type: str, num_cpus: float, pg: PlacementGroup | None = None,
                bundle_indices: list[int] | None = None, timeout_s: float = 60.0) -> GroupPlacement:
    """Reserve (or adopt) one node's worth of bundles for `tp` ranks."""
    if pg is None:
        pg = ray.util.get_current_placement_group()
    if pg is not None:
        n = len(pg.bundle_specs)
        if bundle_indices is None:
            if n < tp:
                raise ValueError(f"placement group has {n} bundles, tensor_parallel_size={tp} needs {tp}")
            bundle_indices = list(range(n - tp, n))
        if len(bundle_indices) != tp or any(not 0 <= b < n for b in bundle_indices):
            raise ValueError(f"bundle_indices {bundle_indices} do not name {tp} bundles of a {n}-bundle placement group")
        owned = False
    else:
        pg = placement_group([rank_resources(device_type, num_cpus)] * tp, strategy="STRICT_PACK",
                             name=f"orbital-tp{tp}-{uuid.uuid4().hex[:8]}")
        bundle_indices, owned = list(range(tp)), True
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        if owned:
            remove_placement_group(pg)
        raise EngineDeadError(
            f"cannot place a tensor-parallel group of {tp} ranks on one node within {timeout_s:.0f}s: each rank "
            f"needs {rank_resources(device_type, num_cpus)} and STRICT_PACK needs them all on one node "
            f"(cluster resources: {ray.available_resources()})")
    return GroupPlacement(pg, bundle_indices, owned)
