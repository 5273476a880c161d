"""GGUF Q8_0 / Q4_0 / Q4_1 blocks loaded as they are (engine/model/gguf_weights.py): the decoded
integers and scales give exactly the values `gguf.quants.dequantize` gives, on random data and
on the embedded model's own tensors; llama.cpp's q/k row permutation is undone as transformers
undoes it; the packed int4 form (Q8_0 as two nibbles) keeps those values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import GGMLQuantizationType, dequantize, quantize

from engine.layers.quant.blocks import BlockQuantized, assemble
from engine.layers.quant.int4 import int4_linear
from engine.layers.quant.int4_format import dequantize_int4, embedding_int4, pack_int4
from engine.model.gguf_weights import decode_blocks, unpermute_rows

KINDS = ["Q8_0", "Q4_0", "Q4_1"]


@pytest.mark.parametrize("kind", KINDS)
def test_decoded_blocks_equal_gguf_dequantize_on_random_data(kind):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((128, 192)) * rng.uniform(0.01, 3, (128, 1))).astype(np.float32)
    x[3] = 0.0  # an all-zero row: scale 0
    raw = quantize(x, GGMLQuantizationType[kind])
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))
    w = decode_blocks(raw, kind, 128, 192)
    assert w.bits == (8 if kind == "Q8_0" else 4) and w.q.shape == (128, 192) and w.scale.shape == (128, 6)
    assert torch.equal(w.dequantize(), ref)


@pytest.fixture(scope="module")
def embedded_reader():
    from gguf import GGUFReader

    from engine.model.gguf_convert import embedded_gguf_path

    return GGUFReader(str(embedded_gguf_path()))


def test_decoded_blocks_equal_gguf_dequantize_on_the_embedded_model(embedded_reader):
    seen = set()
    for t in embedded_reader.tensors:
        kind = t.tensor_type.name
        if kind in KINDS and (kind not in seen or t.name.startswith("blk.0.")):
            seen.add(kind)
            rows, cols = int(t.shape[1]), int(t.shape[0])
            ref = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32).reshape(rows, cols))
            assert torch.equal(decode_blocks(t.data, kind, rows, cols).dequantize(), ref), t.name
    assert seen == {"Q8_0", "Q4_1"}  # what the embedded file holds


def test_row_unpermutation_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for name, rows, heads in [("blk.0.attn_q.weight", 576, 9), ("blk.0.attn_k.weight", 192, 3)]:
        w = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
        expected = proc.process(w, name).weights
        assert np.array_equal(w[unpermute_rows(rows, heads).numpy()], expected)


def _random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> BlockQuantized:
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return decode_blocks(quantize(x, GGMLQuantizationType[kind]), kind, rows, cols)


@pytest.mark.parametrize("kinds", [["Q4_1"], ["Q4_0"], ["Q8_0"], ["Q4_1", "Q8_0"]])
def test_packed_blocks_keep_their_values(kinds):
    """Pieces of one fused parameter (e.g. gate and up), packed for the int4 kernel; a Q8_0 piece
    makes the whole weight two nibbles per value."""
    parts = [(i * 64, _random_blocks(k, 64, 128, seed=i)) for i, k in enumerate(kinds)]
    whole = assemble(parts, 64 * len(kinds) + 32)  # 32 rows no piece covers: zeros
    expected = torch.cat([p.dequantize() for _, p in parts] + [torch.zeros(32, 128)])
    split = whole.bits == 8
    packed = pack_int4(*whole.as_nibbles(split), 32, split=split)
    got = dequantize_int4(packed)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()  # z = min + 8 scale rounds
    x = torch.randn(5, 128)
    ref = x @ expected.t()
    rel = ((int4_linear(x, packed) - ref).norm() / ref.norm()).item()
    assert rel < 0.01, rel  # bf16 activations and scales in the kernel
    ids = torch.tensor([[0, 65, 90, 40], [7, 7, 1, 33]])  # both nibbles of a pack's bytes
    assert torch.equal(embedding_int4(packed, ids, torch.float32), got[ids])


@pytest.mark.slow
def test_a_cut_gguf_keeps_the_first_layers_blocks(embedded_reader, tmp_path):
    """tests/engine/gguf_subset.py (what the GPU tests run a real GGUF from): the first layer's
    and the shared tensors' blocks byte for byte, the metadata with one block (the GPU test
    loads and runs such a file on both devices)."""
    from gguf import GGUFReader

    from engine.model.gguf_convert import embedded_gguf_path
    from tests.engine.gguf_subset import write_gguf_subset

    cut = GGUFReader(str(write_gguf_subset(embedded_gguf_path(), tmp_path / "one.gguf", 1)))
    src = {t.name: t for t in embedded_reader.tensors}
    names = [t.name for t in cut.tensors]
    assert names == [n for n in src if not n.startswith("blk.") or n.startswith("blk.0.")]
    for t in cut.tensors:
        assert t.tensor_type == src[t.name].tensor_type and np.array_equal(t.data, src[t.name].data), t.name
    assert cut.fields["llama.block_count"].contents() == 1
