"""The fused CPU RMSNorm / SiLU-and-mul / rotary ops against the layers' PyTorch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding

# float32: summation order only; bf16: at most one bf16 ulp where a float sum rounds differently.
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def ran(ops, result: bool) -> bool:
    """The ops run wherever the build has a vector path (AVX-512 or AVX2) and decline on generic
    builds, where the layers run PyTorch's path (which the tests then check instead)."""
    assert result == (ops.isa() != "generic"), (ops.isa(), result)
    return result


def _rows(t, h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 7, 300])
def test_rms_norm_with_and_without_residual(ops, dtype, t):
    norm = RMSNorm(576, 1e-5, dtype)
    norm.weight.copy_(torch.rand(576) + 0.5)
    x, res = _rows(t, 576, dtype, 1), _rows(t, 576, dtype, 2)
    want_res = x + res
    want = norm._norm(want_res)
    x2, r2 = x.clone(), res.clone()
    if ran(ops, ops.rms_norm(x2, r2, norm.weight, 1e-5)):
        assert torch.equal(r2, want_res)  # the stored sum is rounded exactly as PyTorch's add
        torch.testing.assert_close(x2, want, **TOL[dtype])
    else:  # declined: nothing written
        assert torch.equal(x2, x) and torch.equal(r2, res)
    alone = x.clone()
    if ran(ops, ops.rms_norm(alone, None, norm.weight, 1e-5)):
        torch.testing.assert_close(alone, norm._norm(x), **TOL[dtype])
    # through the layer: the input without residual is left alone
    before = x.clone()
    torch.testing.assert_close(norm(x), norm._norm(before), **TOL[dtype])
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(ops, dtype):
    x = _rows(33, 2 * 1536, dtype, 3)
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # saturated sigmoid both ways
    out = torch.empty(33, 1536, dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    if not ran(ops, ops.silu_and_mul(x, out)):
        out = SiluAndMul()(x)  # the layer's PyTorch path
    torch.testing.assert_close(out, F.silu(gate) * up, **TOL[dtype])
    assert out.isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rotary_in_place_on_fused_qkv(ops, dtype, head_dim):
    hq, hkv, t = 6, 2, 19
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0, "rope_type": "default"}, dtype)
    qkv = _rows(t, (hq + 2 * hkv) * head_dim, dtype, 4)
    positions = torch.randint(0, 4096, (t,))
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    wq, wk = rope(positions, q.reshape(t, hq, head_dim), k.reshape(t, hkv, head_dim))
    v_before = v.clone()
    if not ran(ops, rope.rotate_in_place(positions, qkv, hq + hkv)):
        before = qkv.clone()  # declined and untouched: the model rotates through rope() instead
        q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
        assert torch.equal(qkv, before)
        return
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    torch.testing.assert_close(q.reshape(t, hq, head_dim), wq, **TOL[dtype])
    torch.testing.assert_close(k.reshape(t, hkv, head_dim), wk, **TOL[dtype])
    assert torch.equal(v, v_before)


def test_ops_decline_what_they_do_not_cover(ops):
    w = torch.ones(20)
    assert not ops.rms_norm(torch.randn(3, 20), None, w, 1e-6)  # width not a multiple of 16
    assert not ops.rms_norm(torch.randn(3, 32, dtype=torch.float64), None, torch.ones(32, dtype=torch.float64), 1e-6)
    assert not ops.silu_and_mul(torch.randn(3, 40), torch.empty(3, 20))
    cos = torch.zeros(8, 80)
    assert not ops.rotary(torch.randn(2, 160), torch.tensor([0, 1]), cos, cos, 2, 80)  # half 40: no vector path
    if ops.isa() == "generic":
        return  # every op declines before looking at its input
    with pytest.raises(RuntimeError, match="position out of range"):
        ops.rotary(torch.randn(2, 128), torch.tensor([0, 8]), torch.zeros(8, 64), torch.zeros(8, 64), 2, 64)
