"""Moving a prefill's KV blocks from a prefill replica to a decode replica through Ray.

The prefill replica puts the block contents in the Ray object store and returns a `KVHandle`
(an ObjectRef and the layout) inside its answer; the decode replica fetches the contents
(shared memory on one node, Ray's object transfer between nodes) and writes them into its own
blocks. Ray's ownership rules give the lease: the contents live while the decode side holds the
ref, are freed when it drops it, and a prefill replica that dies first makes the fetch raise
(OwnerDiedError), which the decode side answers by recomputing. The blocks in the prefill
engine were copied out before its step thread freed them, so neither side ever reads a block
the other has reused, and a slow or dead decode replica never pins the prefill pool's blocks.

Ray's direct tensor transport (RDT, `tensor_transport="gloo"|"nccl"|"nixl"`) would skip the
object store, but it is declared on the methods of actors one creates and on collective groups
fixed at creation; Serve replicas come and go under autoscaling and their methods are Serve's.
The object store works between any two replicas on CPU and GPU nodes alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

from engine.kv_transfer.blocks import KVBlocks, KVLayout


@dataclass(frozen=True)
class KVHandle:
    ref: ray.ObjectRef  # the (layers, 2, kv heads, blocks, block_size, head_dim) tensor
    layout: KVLayout
    first_block: int
    num_tokens: int
    num_blocks: int
    nbytes: int


def send_kv(blocks: KVBlocks) -> KVHandle:
    """Prefill side: the contents go into the object store, owned by this process."""
    data = blocks.data.contiguous()
    return KVHandle(
        ray.put(data), blocks.layout, blocks.first_block, blocks.num_tokens, blocks.num_blocks, blocks.nbytes
    )


async def receive_kv(handle: KVHandle) -> KVBlocks:
    """Decode side: fetch the contents (raises if the prefill replica died before)."""
    data = await handle.ref
    return KVBlocks(handle.layout, handle.first_block, handle.num_tokens, data)
