"""One tensor-parallel group as a torch.distributed process group (NCCL on CUDA, gloo on CPU).

Rendezvous: rank 0 opens a TCPStore on its node address with port 0, so the OS picks a free
port atomically (no probe-then-bind race), and hands (address, port) to the other ranks.
Each group has its own store and port, so many groups on one node never collide.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from engine.distributed import set_tp_group

DEFAULT_TIMEOUT_S = float(os.environ.get("ORBITAL_TP_COLLECTIVE_TIMEOUT_S", "120"))


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def node_address() -> str:
    """This node's address as Ray knows it (what other processes on the node can reach)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (plain torchrun-style use)
        return "127.0.0.1"


def open_rendezvous(world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[str, int, object]:
    """Rank 0: start the group's TCPStore on a free port. Returns (address, port, store)."""
    addr = node_address()
    store = dist.TCPStore(addr, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return addr, store.port, store


def join_group(rank: int, world_size: int, addr: str, port: int, device: str | torch.device,
               store: object | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the group (all ranks call this at once) and publish it to the engine's layers."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    backend = backend_for(device)
    kwargs = {}
    if backend == "nccl":
        dev = torch.device(device)
        dev = torch.device("cuda", dev.index if dev.index is not None else 0)
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    set_tp_group(world_size, rank, dist.group.WORLD)
    # Warm the communicator (NCCL creates it lazily) and check that everybody is here.
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    if int(t.item()) != world_size:
        raise RuntimeError(f"process group check failed: all_reduce gave {t.item()}, expected {world_size}")


def leave_group() -> None:
    """Abandon the group; peers blocked in a collective with us fail instead of waiting."""
    set_tp_group(1, 0, None)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
