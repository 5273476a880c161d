"""One rank's offload store: fixed-size slots, each holding one block of this rank's KV shard
behind a header that names the block's hash, its size and a CRC-32 of its bytes.

Backed by one memory-mapped file per rank ("disk", preallocated so a full disk fails at start,
not in a step) or by host memory ("host", pinned when CUDA is there). The scheduler (rank 0)
owns the slots (index.py); every rank's store has the same slots over its own shard. A slot is
read back only when its header matches what the scheduler expects and its bytes match their
checksum: a slot never written, overwritten, torn, truncated, or whose file was removed or
replaced reads as a miss, and the block is recomputed instead.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import tempfile
import uuid
import zlib

import torch

from engine.layers.attention.kv_quant import byte_view

MAGIC = b"ORBKV\x00\x01\x00"
HEADER = struct.Struct("<8s32sQI")  # magic, block hash (256 bits), payload bytes, CRC-32
HEADER_BYTES = 64  # the payload starts here (aligned for every cache dtype)
PAGE = 4096


def slot_bytes(block_nbytes: int) -> int:
    """A slot's stride: the header and one block, rounded up to whole pages."""
    return -(-(HEADER_BYTES + block_nbytes) // PAGE) * PAGE


class OffloadStore:
    def __init__(
        self,
        num_slots: int,
        block_nbytes: int,
        medium: str = "disk",
        directory: str | None = None,
        rank: int = 0,
        pin: bool = False,
    ) -> None:
        self.num_slots, self.block_nbytes, self.medium = num_slots, block_nbytes, medium
        self.stride = slot_bytes(block_nbytes)
        self.size = self.stride * num_slots
        self.path: str | None = None
        self._tmpdir: str | None = None
        self._mm: mmap.mmap | None = None
        self._fd: int | None = None
        if medium == "disk":
            if directory is None:
                directory = self._tmpdir = tempfile.mkdtemp(prefix="orbital-kv-offload-")
            self.directory, self.rank = directory, rank
            self._open_file()
        elif medium == "host":
            self.buf = torch.zeros(self.size, dtype=torch.uint8, pin_memory=pin)
        else:
            raise ValueError(f"unknown offload medium {medium!r}")
        self.seconds_saving = self.seconds_loading = 0.0  # cumulative, for benchmarks

    def _open_file(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        self.path = os.path.join(self.directory, f"rank{self.rank}-{uuid.uuid4().hex[:12]}.kv")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(self._fd, 0, self.size)
        except OSError:  # a file system without fallocate: a sparse file
            os.ftruncate(self._fd, self.size)
        self._ino = os.fstat(self._fd).st_ino
        self._mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED)
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)

    def renew(self) -> None:
        """After `usable()` turned False: map a fresh, empty file (a page past a cut-short
        file's end must never be touched: the process would get SIGBUS). Every slot reads as
        a miss until written again."""
        self._release()
        self._open_file()

    def usable(self) -> bool:
        """False when the disk file was removed, replaced or cut short under us."""
        if self.path is None:
            return True
        try:
            st = os.stat(self.path)
            return st.st_ino == self._ino and os.fstat(self._fd).st_size >= self.size
        except OSError:
            return False

    def _slot(self, slot: int) -> torch.Tensor:
        return self.buf[slot * self.stride : slot * self.stride + HEADER_BYTES + self.block_nbytes]

    def _payload(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """`slot`'s block bytes seen with `like`'s dtype and shape (a quantized cache as bytes)."""
        if like.numel() * like.element_size() != self.block_nbytes:
            raise ValueError(f"block has {like.numel() * like.element_size()} bytes, the slots {self.block_nbytes}")
        start = slot * self.stride + HEADER_BYTES
        return self.buf[start : start + self.block_nbytes].view(like.dtype).view(like.shape)

    def write(self, slot: int, block_hash: int, data: torch.Tensor) -> None:
        """Store one block (this rank's shard, as one contiguous write) in `slot`. The header is
        cleared first and written last: a write cut short reads as a miss."""
        src = byte_view(data)
        head = self.buf[slot * self.stride : slot * self.stride + HEADER.size]
        head.zero_()
        payload = self._payload(slot, src)
        payload.copy_(src)
        crc = zlib.crc32(payload.view(torch.uint8).reshape(-1).numpy())
        packed = HEADER.pack(MAGIC, block_hash.to_bytes(32, "big"), self.block_nbytes, crc)
        head.copy_(torch.frombuffer(bytearray(packed), dtype=torch.uint8))

    def read(self, slot: int, block_hash: int, out: torch.Tensor) -> bool:
        """Copy `slot`'s block into `out` (any strides) when the slot holds `block_hash` intact;
        False, `out` untouched, otherwise."""
        head = self.buf[slot * self.stride : slot * self.stride + HEADER.size].numpy().tobytes()
        magic, stored, nbytes, crc = HEADER.unpack(head)
        if magic != MAGIC or stored != block_hash.to_bytes(32, "big") or nbytes != self.block_nbytes:
            return False
        dst = byte_view(out)
        payload = self._payload(slot, dst)
        if zlib.crc32(payload.view(torch.uint8).reshape(-1).numpy()) != crc:
            return False
        dst.copy_(payload)
        return True

    def drop_cached_pages(self) -> None:
        """Write the disk tier back and let the kernel drop its pages from memory, so the next
        reads come from the device (a tier larger than memory; bench/bench_kv_offload.py)."""
        if self._mm is None:
            return
        self._mm.flush()
        self._mm.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _release(self) -> None:
        """Unmap and close the file; remove it unless it was replaced by another file."""
        self.buf = torch.empty(0, dtype=torch.uint8)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view still alive somewhere: the mapping goes with it
                pass
            self._mm = None
        if self._fd is not None:
            try:
                if os.stat(self.path).st_ino == self._ino:
                    os.unlink(self.path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Release the memory and remove the file (and the temporary directory made for it)."""
        self._release()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
