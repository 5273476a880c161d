"""The fused C++ CPU ops against the PyTorch formulas they replace (transformers' Llama order)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu_ops import load_cpu_ops

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ toolchain: the PyTorch path is used and tested")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _norm_ref(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_residual(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=g).to(dtype)
    r = torch.randn(37, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    assert (ops.rms_norm(x, w, 1e-5).float() - _norm_ref(x, w, 1e-5).float()).abs().max() < TOL[dtype]
    new_r = x + r
    want = _norm_ref(new_r, w, 1e-5)
    xx, rr = x.clone(), r.clone()
    ops.fused_add_rms_norm(xx, rr, w, 1e-5)
    assert torch.equal(rr, new_r)
    assert (xx.float() - want.float()).abs().max() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_strided_qkv_views(dtype):
    from engine.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(1)
    t, hq, hk, d = 11, 6, 2, 64
    rope = RotaryEmbedding(d, 512, {"rope_theta": 10000.0, "rope_type": "default"}, dtype)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    pos = torch.randint(0, 512, (t,), generator=g)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)

    def rot(x):
        cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return x.float() * cos.float() + torch.cat((-x2, x1), dim=-1) * sin.float()

    want_q, want_k, v_before = rot(q), rot(k), qkv[:, (hq + hk) * d :].clone()
    ops.rotary_inplace(q.view(t, -1), k.view(t, -1), pos, rope.cos, rope.sin, d)
    assert (q.float() - want_q).abs().max() < TOL[dtype] * 4
    assert (k.float() - want_k).abs().max() < TOL[dtype] * 4
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(2)).to(dtype) * 4
    gate, up = x.float().chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = ops.silu_and_mul(x)
    assert got.shape == (9, 1536)
    assert ((got.float() - want).abs() / (want.abs() + 1)).max() < TOL[dtype]
