"""Packed oneDNN linears (engine/layers/packed_gemm.py) against F.linear, and their use in the model."""

import pytest
import torch
import torch.nn.functional as F

from engine.layers.packed_gemm import linear, pack_weight, packing_enabled, row_bucket

DTYPES = [d for d in (torch.float32, torch.bfloat16) if packing_enabled(d, torch.device("cpu"))]


def test_row_buckets_cover_and_stay_few():
    sizes = {row_bucket(m) for m in range(0, 2049)}
    assert all(row_bucket(m) >= m for m in range(0, 2049))
    assert all(row_bucket(m) - m < max(8, m / 8) for m in range(1, 2049))
    assert len(sizes) <= 64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [0, 1, 7, 48, 129, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, m, bias):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(96, 80, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    x = torch.randn(m, 80, generator=g).to(dtype)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = linear(x, pack_weight(w), b)
    assert out.shape == (m, 96) and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.skipif(not DTYPES, reason="oneDNN is not available in this torch build")
def test_packed_linear_keeps_leading_dims_and_reads_strided_input():
    w = torch.randn(32, 24)
    x = torch.randn(3, 5, 40)[..., 8:32]  # a strided view, as after a split
    torch.testing.assert_close(linear(x, pack_weight(w)), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_plain_weight_takes_f_linear():
    w, x = torch.randn(8, 4), torch.randn(2, 4)
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.skipif(not DTYPES, reason="oneDNN is not available in this torch build")
def test_model_linears_are_packed_and_switch_off(monkeypatch, smollm_dir):
    from transformers import AutoConfig

    from engine.model.loader import load_model

    cfg = AutoConfig.from_pretrained(smollm_dir)
    models = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("ORBITAL_PACKED_GEMM", flag)
        models[flag] = load_model(smollm_dir, cfg, torch.float32, torch.device("cpu"), 64)
    packed, plain = models["1"], models["0"]
    layer = packed.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.is_mkldnn and layer.mlp.down_proj.weight.is_mkldnn
    assert not plain.model.layers[0].mlp.down_proj.weight.is_mkldnn
    assert packed.tie_word_embeddings  # SmolLM2: the embedding lookup keeps the plain tensor
    assert not packed.model.embed_tokens.weight.is_mkldnn and packed.lm_head.packed_weight.is_mkldnn
    ids = torch.tensor([1, 5, 9, 2, 300, 4000, 7])
    with torch.inference_mode():
        outs = [
            (m.model.layers[3].mlp(m.model.embed_tokens(ids)), m.compute_logits(m.model.embed_tokens(ids)))
            for m in (packed, plain)
        ]
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
