"""A GGUF file's tensors under Hugging Face Llama names, one tensor at a time.

Q8_0 / Q4_0 / Q4_1 weights come out as BlockQuantized (their integers and per-block scale and
min, decoded from the bytes, never float); other types as float32 tensors. llama.cpp's
converter permutes the rows of q and k (rotary halves interleaved); we undo it exactly as
transformers' GGUF loader does, on whole rows, so quantized rows move with their scales.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engine.layers.quant.blocks import BLOCK, BlockQuantized

_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None: not a weight we use)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    if gguf_name == "rope_freqs.weight":
        return None
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")


def decode_blocks(raw: np.ndarray, kind: str, rows: int, cols: int) -> BlockQuantized:
    """Bytes [rows, cols / 32 * block bytes] -> BlockQuantized, laid out as ggml lays them out."""
    b = torch.from_numpy(np.array(raw, copy=True).reshape(rows * cols // BLOCK, -1))
    d = b[:, :2].contiguous().view(torch.float16).float()  # [blocks, 1]
    if kind == "Q8_0":
        q = b[:, 2:].contiguous().view(torch.int8)
        return _shaped(q, d, torch.zeros_like(d), 8, kind, rows, cols)
    if kind == "Q4_0":
        m, qs = -8 * d, b[:, 2:]
    elif kind == "Q4_1":
        m, qs = b[:, 2:4].contiguous().view(torch.float16).float(), b[:, 4:]
    else:
        raise ValueError(f"{kind} blocks are not loaded as they are")
    q = torch.cat([qs & 15, qs >> 4], dim=1)  # low nibbles are values 0..15, high ones 16..31
    return _shaped(q, d, m, 4, kind, rows, cols)


def _shaped(q, d, m, bits, kind, rows, cols) -> BlockQuantized:
    nb = cols // BLOCK
    return BlockQuantized(q.reshape(rows, cols), d.reshape(rows, nb), m.reshape(rows, nb), bits, kind)


BLOCK_KINDS = ("Q8_0", "Q4_0", "Q4_1")


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute_weights)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def iterate_gguf_weights(path: str | Path, hf_config: object, keep_blocks: bool = True) -> Iterator[tuple[str, object]]:
    """Yield (HF name, float32 tensor or BlockQuantized). keep_blocks=False: every tensor as
    float32 (still one at a time)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        kind = t.tensor_type.name
        shape = [int(x) for x in reversed(t.shape.tolist())]  # ggml lists the fastest dimension first
        if kind in BLOCK_KINDS and len(shape) == 2:
            w = decode_blocks(t.data, kind, *shape)
            if not keep_blocks:
                w = w.dequantize()
        else:
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
        proj = name.split(".")[-2]
        if proj in heads and name.endswith(".weight"):
            order = unpermute_rows(shape[0], heads[proj])
            w = w.index_rows(order) if isinstance(w, BlockQuantized) else w[order]
        yield name, w
