"""A replica's ranks as torch.distributed process groups (NCCL on CUDA, gloo on CPU): at pp=1
one group, the tensor-parallel group; at pp>1 a world group of every rank (the stages'
point-to-point hops, engine/pipeline.py) and one tensor-parallel group per stage, each on its
own prefix of the one store.

Rendezvous: rank 0 (the driver) opens a TCPStore on its node address with port 0, so the OS
picks a free port atomically (no probe-then-bind race), and hands (address, port) to the other
ranks. Each group has its own store and port, so many groups on one node never collide.

The group object is built directly rather than through `init_process_group`, so one process
(the driver) can hold several groups, one per engine. Dropping the last reference to a gloo
group closes its connections: that is how a rank leaves, and peers blocked in a collective
with it fail at once ("Connection closed by peer") instead of waiting.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from engine.distributed import TPGroup
from engine.pipeline_group import PPGroup, make_pp_group

# Bounds a collective whose peer neither answers nor closes (a frozen process): the error
# path for a dead or failed peer is the closed connection, not this timeout. Ranks sit in no
# collective between steps, so an idle engine never runs into it.
DEFAULT_TIMEOUT_S = float(os.environ.get("ORBITAL_TP_COLLECTIVE_TIMEOUT_S", "60"))
# Joining waits for every rank's actor to start (imports, a busy node): longer.
RENDEZVOUS_TIMEOUT_S = 300.0


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def node_address() -> str:
    """This node's address as Ray knows it (what other processes on the node can reach)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (plain torchrun-style use)
        return "127.0.0.1"


def open_rendezvous(world_size: int, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> tuple[str, int, object]:
    """Rank 0: start the group's TCPStore on a free port. Returns (address, port, store)."""
    addr = node_address()
    store = dist.TCPStore(
        addr, 0, world_size, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return addr, store.port, store


def join_group(
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    device: str | torch.device,
    store: object | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TPGroup:
    """Join the group (all ranks call this at once); returns it for the caller to bind."""
    store = _client_store(addr, port, world_size) if store is None else store
    return TPGroup(size=world_size, rank=rank, group=_new_group(store, rank, world_size, device, timeout_s))


def join_pipeline_groups(
    rank: int,
    tp: int,
    pp: int,
    layers: range,
    addr: str,
    port: int,
    device: str | torch.device,
    store: object | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[TPGroup, PPGroup]:
    """pp > 1: join the world group and this rank's stage group (every rank at once). `layers`:
    this rank's stage's decoder layers."""
    world = tp * pp
    store = _client_store(addr, port, world) if store is None else store
    stage, tp_rank = divmod(rank, tp)
    world_group = _new_group(dist.PrefixStore("world", store), rank, world, device, timeout_s)
    tp_group = _new_group(dist.PrefixStore(f"stage{stage}", store), tp_rank, tp, device, timeout_s) if tp > 1 else None
    return TPGroup(size=tp, rank=tp_rank, group=tp_group), make_pp_group(stage, tp_rank, tp, pp, layers, world_group)


def _client_store(addr: str, port: int, world_size: int) -> object:
    """A rank's connection to rank 0's store."""
    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)


def _new_group(store: object, rank: int, world_size: int, device: str | torch.device, timeout_s: float) -> object:
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend_for(device) == "nccl":
        dev = torch.device(device)
        torch.cuda.set_device(torch.device("cuda", dev.index if dev.index is not None else 0))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    else:
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    # Warm the communicator (NCCL creates it lazily) and check that everybody is here.
    t = torch.ones(1, device=device)
    dist.all_reduce(t, group=pg)
    if int(t.item()) != world_size:
        raise RuntimeError(f"process group check failed: all_reduce gave {t.item()}, expected {world_size}")
    return pg


def abort_group(tp: TPGroup | PPGroup | None) -> None:
    """NCCL needs an explicit abort for peers' pending collectives to fail; gloo closes when
    the caller drops its last reference to the group."""
    if tp is not None and tp.group is not None and hasattr(tp.group, "abort") and backend_name(tp) == "nccl":
        try:
            tp.group.abort()
        except Exception:
            pass


def backend_name(tp: TPGroup | PPGroup) -> str:
    return "nccl" if type(tp.group).__name__ == "ProcessGroupNCCL" else "gloo"
