"""Q4_K and Q6_K encoders for tests (the gguf package decodes K-quants but does not make them):
round-to-nearest within ggml's layouts, without llama.cpp's search for the best scales, so a test
can re-encode a real model's weights as a Q4_K_M file holds them. Checked against
`gguf.quants.dequantize` in tests/engine/test_gguf_kquants.py."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 (cols a multiple of 256) -> Q4_K bytes [rows, cols / 256 * 144]."""
    rows = x.shape[0]
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    m_f = np.maximum(-sub.min(-1), 0)  # value = d * sc * q - dmin * m, m >= 0
    s_f = (sub.max(-1) + m_f) / 15
    d, dmin = _f16(s_f.max(-1, keepdims=True) / 63), _f16(m_f.max(-1, keepdims=True) / 63)
    df, dminf = d.astype(np.float32), dmin.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(s_f / df)), 0, 63).astype(np.uint8)
        m = np.clip(np.nan_to_num(np.round(m_f / dminf)), 0, 63).astype(np.uint8)
        scale, mn = df * sc, dminf * m
        q = np.nan_to_num(np.round((sub + mn[..., None]) / scale[..., None]))
    q = np.clip(q, 0, 15).astype(np.uint8)
    packed = np.zeros((sub.shape[0], 12), np.uint8)  # ggml's get_scale_min_k4, inverted
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2c (low) and 2c + 1 (high)
    out = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, qs], axis=1)
    return out.reshape(rows, -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 (cols a multiple of 256) -> Q6_K bytes [rows, cols / 256 * 210]."""
    rows = x.shape[0]
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    s_f = np.abs(sub).max(-1) / 31
    d = _f16(s_f.max(-1, keepdims=True) / 127)
    df = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(s_f / df)), -128, 127).astype(np.int8)
        scale = df * sc
        q = np.nan_to_num(np.round(sub / scale[..., None]))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 2, 64)  # [block, half, nibble shift, byte]
    ql = ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(-1, 128)
    hi = (q >> 4).reshape(-1, 2, 4, 32)  # value h * 128 + s * 32 + j: bits 2s of qh[h * 32 + j]
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=1)
    return out.reshape(rows, -1)


def encode(x: np.ndarray, kind: str) -> np.ndarray:
    """A float32 [rows, cols] weight in `kind`'s bytes (K-quants here, the rest by gguf)."""
    if kind == "Q4_K":
        return encode_q4_k(x)
    if kind == "Q6_K":
        return encode_q6_k(x)
    return quantize(x.astype(np.float32), GGMLQuantizationType[kind])
