"""A block-quantized checkpoint tensor (a GGUF weight, decoded from its bytes but not to float:
engine/model/gguf_blocks.py): integer values and a float scale and min per group of 16 or 32
inputs, so that the weight is `q * scale + min`. It slices like a tensor (rows, or whole blocks of columns), so the
tensor-parallel weight loaders cut it as they cut float weights; the layers then pack it for the
int4 kernel (int4.py) without a float round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # the usual group (Q8_0, Q4_*, Q5_*, Q4_K, Q5_K); Q2_K, Q3_K and Q6_K have 16


@dataclass
class BlockQuantized:
    q: torch.Tensor  # [N, K]: uint8 0..15 (bits=4) or int8 (bits=8)
    scale: torch.Tensor  # [N, K / BLOCK] float32
    minimum: torch.Tensor  # [N, K / BLOCK] float32
    bits: int
    kind: str = ""  # the GGUF type it came from, for messages
    group: int = BLOCK  # inputs per scale and min
    # Columns held in this order of the inputs (GPTQ act-order: a group's inputs gathered), so
    # the kernels take x[:, input_order]; None: the inputs' own order.
    input_order: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def narrow(self, dim: int, start: int, length: int) -> BlockQuantized | torch.Tensor:
        if dim == 1 and start == 0 and length == self.shape[1]:
            return self
        if dim == 1 and self.input_order is not None:
            # A slice of the inputs (a row-parallel shard) cuts groups whose inputs are scattered
            # over all of them: that shard is its exact float values.
            return self.dequantize().narrow(1, start, length)
        if dim == 1:
            g = self.group
            if start % g or length % g:
                raise ValueError(f"a {self.kind} weight is sliced by whole groups of {g} inputs")
            bs, bl = start // g, length // g
            return BlockQuantized(
                self.q[:, start : start + length],
                self.scale[:, bs : bs + bl],
                self.minimum[:, bs : bs + bl],
                self.bits,
                self.kind,
                g,
            )
        sl = slice(start, start + length)
        return self.index_rows(sl)

    def index_rows(self, rows: torch.Tensor | slice) -> BlockQuantized:
        return BlockQuantized(
            self.q[rows], self.scale[rows], self.minimum[rows], self.bits, self.kind, self.group, self.input_order
        )

    def regrouped(self, group: int) -> BlockQuantized:
        """The same values with a smaller group that divides this one (each scale and min repeated):
        exact, so that pieces with different groups share one packed weight."""
        if group == self.group:
            return self
        r = self.group // group
        return BlockQuantized(
            self.q,
            self.scale.repeat_interleave(r, dim=1),
            self.minimum.repeat_interleave(r, dim=1),
            self.bits,
            self.kind,
            group,
            self.input_order,
        )

    def dequantize(self) -> torch.Tensor:
        """Float32 in the inputs' own order, computed as gguf's dequantize computes it (so the
        values are equal)."""
        n, k = self.shape
        q = self.q.float().view(n, k // self.group, self.group)
        w = (q * self.scale[..., None] + self.minimum[..., None]).view(n, k)
        if self.input_order is None:
            return w
        out = torch.empty_like(w)
        out[:, self.input_order] = w
        return out

    def as_nibbles(self, split: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q 0..15, scale, min) for int4_format.pack_int4; `split` (any 8-bit part in the weight):
        [hi | lo] halves along the inputs, q = 16 * hi + lo, hi shifted by 8 into 0..15, the min
        on the lo half."""
        if not split:
            return self.q, self.scale, self.minimum
        q = self.q.to(torch.int16)
        hi = torch.div(q, 16, rounding_mode="floor")  # -8..7
        lo = (q - 16 * hi).to(torch.uint8)
        scale_hi = 16 * self.scale  # (hi + 8) * 16d - 128d = 16 d hi
        return (
            torch.cat([(hi + 8).to(torch.uint8), lo], 1),
            torch.cat([scale_hi, self.scale], 1),
            torch.cat([-8 * scale_hi, self.minimum], 1),  # the hi half's value 16 d hi is exact
        )

    def as_five_bits(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(low nibbles, high bits, scale, min) for int4_format.pack_int4 where every row's values
        span at most 32 (Q5_0's -16..15, Q5_1's and Q5_K's 0..31, or a 4-bit piece's 0..15 beside
        them): each row's values are shifted by its least, q' = q - lo in 0..31, and its mins by
        lo * scale, where that sum is exact in float32 (so that q' * scale + min' is the same
        value). None where a row spans more (8-bit values) or a min would round."""
        if self.bits != 8:
            return None
        q = self.q.to(torch.int16)
        lo = q.amin(1, keepdim=True)
        if int((q.amax(1, keepdim=True) - lo).max()) > 31:
            return None
        minimum = self.minimum + lo.float() * self.scale
        if not torch.equal(minimum.double(), self.minimum.double() + lo.double() * self.scale.double()):
            return None
        q5 = (q - lo).to(torch.uint8)
        return q5 & 15, q5 >> 4, self.scale, minimum


def assemble(parts: list[tuple[int, BlockQuantized]], rows: int) -> BlockQuantized:
    """Row pieces (offset, block weight) of one parameter -> the whole [rows, K] in the widest
    bits and the smallest group among them; rows no piece covers (a padded vocabulary shard) are
    zeros."""
    first = parts[0][1]
    k = first.shape[1]
    order = first.input_order
    if any(not _same_order(p.input_order, order) for _, p in parts):
        raise ValueError("the pieces of one weight hold their inputs in different orders")
    bits = max(p.bits for _, p in parts)
    group = min(p.group for _, p in parts)
    dtype = torch.int8 if bits == 8 else torch.uint8
    q = torch.zeros(rows, k, dtype=dtype)
    scale = torch.zeros(rows, k // group)
    minimum = torch.zeros(rows, k // group)
    kinds = []
    for off, p in parts:
        kinds += [p.kind] if p.kind not in kinds else []
        p = p.regrouped(group)
        if p.bits != bits:  # a 4-bit piece beside 8-bit ones: its 0..15 held as int8, the same values
            p = BlockQuantized(p.q.to(torch.int8), p.scale, p.minimum, 8, p.kind, group)
        n = p.shape[0]
        q[off : off + n], scale[off : off + n], minimum[off : off + n] = p.q, p.scale, p.minimum
    return BlockQuantized(q, scale, minimum, bits, "+".join(kinds), group, order)


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
