"""The runner half of the offload tier: one rank copies blocks of its KV shard out to its store
and back, at the start of each step that carries saves or loads.

`OffloadIO.start` copies the blocks to save out of the pool on the step thread: that must be
done before the step's tail copies and forward write any block (a saved block is being given to
a new owner). The rest, the store writes of those copies (checksums, the file's pages) and then
the loads (read, check, copy into their blocks), runs on one I/O thread beside the step's
forward where that pays, else on the step thread before it. The loads' blocks are fresh and
unpublished: nothing in the step reads or writes them. `finish` waits for the thread at the end
of the same step, so the scheduler's protocol is the same either way (a load is done when its
step's output is), and a step that fails still waits before its blocks can be freed. One thread
keeps the order: saves go before loads (a hash saved in a step may be loaded in the same step),
and a slot's write before a later step's read of it.

Where it pays: on CUDA, the thread's copies run on a side stream (which first waits for the
step thread's stream), so they overlap the GPU's forward. On a CPU the I/O is CPU work that
competes with the forward for the same cores: measured on a 2-core EPYC with decoding streams
beside the tier's traffic (`python -m bench.bench_kv_offload --beside 6`), the I/O thread cut
the step thread's time on the tier 4x but made the run 4% slower, so CPUs run it on the step
thread. Block contents move through the KV hand-off's own copier (engine/kv_transfer/block_io.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.kv_offload.store import OffloadStore
from engine.kv_transfer.block_io import read_blocks, write_blocks

log = logging.getLogger(__name__)


def save_blocks(store: OffloadStore, data: torch.Tensor, saves: list[tuple[int, int, int]]) -> None:
    """(block id, slot, hash), the blocks' contents as `read_blocks` copied them: each into its
    slot, one contiguous write per block. A failed write leaves its slot unreadable (a miss)."""
    t0 = time.perf_counter()
    for i, (_, slot, block_hash) in enumerate(saves):
        try:
            store.write(slot, block_hash, data[:, :, :, i])
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("offload tier: saving a block failed (%s); it will be recomputed", e)
    store.seconds_saving += time.perf_counter() - t0


def load_blocks(kv_caches: list[torch.Tensor], store: OffloadStore, loads: list[tuple[int, int, int]]) -> list[bool]:
    """(slot, block id, hash): each slot's bytes into its block when the slot holds that hash
    intact. Returns which loads failed on this rank (those blocks are left as they were)."""
    t0 = time.perf_counter()
    failed = [True] * len(loads)
    try:
        if store.usable():
            c = kv_caches[0]
            # (n, layers, 2, heads, block, width): one contiguous read per block.
            staging = torch.empty((len(loads), len(kv_caches), *c.shape[:2], *c.shape[3:]), dtype=c.dtype)
            for i, (slot, _, block_hash) in enumerate(loads):
                failed[i] = not store.read(slot, block_hash, staging[i])
            ok = [i for i, f in enumerate(failed) if not f]
            if ok:
                data = staging if len(ok) == len(loads) else staging[ok]
                write_blocks(kv_caches, [loads[i][1] for i in ok], data.permute(1, 2, 3, 0, 4, 5))
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("offload tier: loading blocks failed (%s); they will be recomputed", e)
        failed = [True] * len(loads)
    store.seconds_loading += time.perf_counter() - t0
    return failed


class OffloadIO:
    """One rank's offload I/O for its store. `background`: on the I/O thread (None: on CUDA only,
    where it pays; the module's docstring)."""

    def __init__(self, store: OffloadStore, device: torch.device, background: bool | None = None) -> None:
        self.store, self.device = store, device
        self.background = device.type == "cuda" if background is None else background
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-io")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.seconds_on_step = 0.0  # cumulative: the step thread's time on offload I/O (copy-out, waits)

    def start(
        self, kv_caches: list[torch.Tensor], saves: list[tuple[int, int, int]], loads: list[tuple[int, int, int]]
    ) -> Future:
        """Begin a step's saves and loads; `finish` the returned future before the step's output."""
        t0 = time.perf_counter()
        if not self.store.usable():  # its file removed or cut short: start an empty one
            self.store.renew()
        data = read_blocks(kv_caches, [b for b, _, _ in saves]) if saves else None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.background:
            fut = self._thread.submit(self._run, kv_caches, data, saves, loads)
        else:
            fut = Future()
            fut.set_result(self._run(kv_caches, data, saves, loads))
        self.seconds_on_step += time.perf_counter() - t0
        return fut

    def finish(self, fut: Future) -> list[bool]:
        """Wait for the step's I/O; which of its loads failed on this rank."""
        t0 = time.perf_counter()
        try:
            return fut.result()
        finally:
            self.seconds_on_step += time.perf_counter() - t0

    def _run(self, kv_caches, data, saves, loads) -> list[bool]:
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            if saves:
                save_blocks(self.store, data, saves)
            failed = load_blocks(kv_caches, self.store, loads) if loads else []
            if self._stream is not None:
                self._stream.synchronize()
        return failed

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.store.close()
