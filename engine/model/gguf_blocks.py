"""GGUF block bytes -> BlockQuantized: the integers and each group's scale and min, decoded from
the bytes and never through float, so that `q * scale + min` is exactly what
`gguf.quants.dequantize` gives (every product in ggml's formulas is exact in float32: an fp16
scale has 11 significant bits, a sub-block scale at most 8 and a value at most 6, so each form
of the same sum rounds once, alike).

Kinds and how they are held (q's storage, group of inputs sharing a scale and min):

| kind | ggml's value | q held as | group |
|---|---|---|---|
| Q8_0 | d * q | int8 -128..127 | 32 |
| Q4_0 / Q4_1 | d * (q - 8) / d * q + m | uint8 0..15 | 32 |
| Q5_0 / Q5_1 | d * (q - 16) / d * q + m | int8 -16..15 / 0..31 | 32 |
| Q2_K | d * sc * q - dmin * m | uint8 0..3 | 16 |
| Q3_K | d * (sc - 32) * q, q in -4..3 | uint8 q + 4 (min -4 * scale) | 16 |
| Q4_K | d * sc * q - dmin * m | uint8 0..15 | 32 |
| Q5_K | d * sc * q - dmin * m | int8 0..31 | 32 |
| Q6_K | d * sc * (q - 32) | int8 -32..31 | 16 |

int8 ones whose rows span at most 32 values (Q5_0, Q5_1, Q5_K) run as nibbles plus a plane of high
bits where the CPU ops run them (blocks.py `as_five_bits`: 5 bits a weight, 5.5-6 in the file);
the others (Q8_0, Q6_K, and Q5 on CUDA) as two nibbles (`as_nibbles`): 8 bits a weight, against
6.6-8.5 in the file (float32 would take 32). Other kinds (the IQ, TQ and FP4
families: lookup tables, not affine in q) are not decoded here: gguf_weights.py dequantizes them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from engine.layers.quant.blocks import BlockQuantized

Decoded = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, int, int
]  # q [n, values], scale, min [n, groups], bits, group


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[:, at : at + 2].contiguous().view(torch.float16).float()  # [n, 1]


def _spread(x: torch.Tensor, shifts: list[int], width: int, mask: int) -> torch.Tensor:
    """ggml's bit planes: x [n, bytes] as rows of `width` bytes, each read at every shift; value
    index = (row, shift, byte)."""
    n = x.shape[0]
    s = torch.tensor(shifts, dtype=torch.uint8).view(1, 1, -1, 1)
    return ((x.reshape(n, -1, 1, width) >> s) & mask).reshape(n, -1)


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    return _spread(qs, [0, 4], width, 15)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], 1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], 1)
    return sc.float(), mn.float()


def _q8_0(b: torch.Tensor) -> Decoded:
    d = _f16(b, 0)
    return b[:, 2:].contiguous().view(torch.int8), d, torch.zeros_like(d), 8, 32


def _q4_0(b: torch.Tensor) -> Decoded:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:], 16), d, -8 * d, 4, 32


def _q4_1(b: torch.Tensor) -> Decoded:
    return _nibbles(b[:, 4:], 16), _f16(b, 0), _f16(b, 2), 4, 32


def _five_bits(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1: value j's fifth bit is bit j of the little-endian qh word."""
    high = _spread(qh, list(range(8)), 1, 1).reshape(-1, 4, 8).reshape(-1, 32)  # byte-major bits
    return _nibbles(qs, 16) | (high << 4)


def _q5_0(b: torch.Tensor) -> Decoded:
    d = _f16(b, 0)
    q = _five_bits(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16
    return q, d, torch.zeros_like(d), 8, 32


def _q5_1(b: torch.Tensor) -> Decoded:
    return _five_bits(b[:, 4:8], b[:, 8:]).to(torch.int8), _f16(b, 0), _f16(b, 2), 8, 32


def _q2_k(b: torch.Tensor) -> Decoded:
    scales, d, dmin = b[:, :16], _f16(b, 80), _f16(b, 82)
    q = _spread(b[:, 16:80], [0, 2, 4, 6], 32, 3)
    return q, d * (scales & 15).float(), -(dmin * (scales >> 4).float()), 4, 16


def _q3_k(b: torch.Tensor) -> Decoded:
    hmask, qs, s, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b, 108)
    low = _spread(s[:, :8], [0, 4], 8, 15)
    high = _spread(s[:, 8:], [0, 2, 4, 6], 4, 3)
    scale = d * ((low | (high << 4)).to(torch.int8) - 32).float()
    ql = _spread(qs, [0, 2, 4, 6], 32, 3)
    qh = _spread(hmask, list(range(8)), 32, 1)  # set: no offset; clear: -4
    q = ql + 4 * qh  # (ql - 4 * (1 - qh)) + 4, in 0..7
    return q, scale, -4 * scale, 4, 16


def _q4_k(b: torch.Tensor) -> Decoded:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scale_min(b[:, 4:16])
    return _nibbles(b[:, 16:], 32), d * sc, -(dmin * m), 4, 32


def _q5_k(b: torch.Tensor) -> Decoded:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scale_min(b[:, 4:16])
    q = _nibbles(b[:, 48:], 32) | (_spread(b[:, 16:48], list(range(8)), 32, 1) << 4)
    return q.to(torch.int8), d * sc, -(dmin * m), 8, 32


def _q6_k(b: torch.Tensor) -> Decoded:
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b, 208)
    q = (_nibbles(ql, 64) | (_spread(qh, [0, 2, 4, 6], 32, 3) << 4)).to(torch.int8) - 32
    scale = d * sc.contiguous().view(torch.int8).float()
    return q, scale, torch.zeros_like(scale), 8, 16


_DECODERS: dict[str, tuple[int, int, Callable[[torch.Tensor], Decoded]]] = {
    # kind: (values per block, bytes per block, decoder)
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q2_K": (256, 84, _q2_k),
    "Q3_K": (256, 110, _q3_k),
    "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k),
}
BLOCK_KINDS = tuple(_DECODERS)


def decode_blocks(raw: np.ndarray, kind: str, rows: int, cols: int) -> BlockQuantized:
    """A [rows, cols] weight's bytes (as ggml lays them out, rows after rows) -> BlockQuantized."""
    if kind not in _DECODERS:
        raise ValueError(f"GGUF {kind} blocks are not decoded as they are (decodable: {', '.join(BLOCK_KINDS)})")
    values, size, decoder = _DECODERS[kind]
    if cols % values:
        raise ValueError(f"a {kind} weight's rows ({cols} values) are not whole blocks of {values}")
    b = torch.from_numpy(np.array(raw, copy=True).view(np.uint8).reshape(rows * cols // values, size))
    q, scale, minimum, bits, group = decoder(b)
    groups = cols // group
    return BlockQuantized(
        q.reshape(rows, cols),
        scale.reshape(rows, groups).contiguous(),
        minimum.reshape(rows, groups).contiguous(),
        bits,
        kind,
        group,
    )
