"""A GGUF file's tensors under Hugging Face Llama names, one tensor at a time.

Weights of the kinds gguf_blocks.py decodes (Q8_0, Q4_0/1, Q5_0/1, Q2_K..Q6_K) come out as
BlockQuantized (their integers and per-group scale and min, never float); other types as float32
tensors with gguf's own dequantized values; a type neither can read is refused by name. llama.cpp's
converter permutes the rows of q and k (rotary halves interleaved); we undo it exactly as
transformers' GGUF loader does, on whole rows, so quantized rows move with their scales.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engine.layers.quant.blocks import BlockQuantized
from engine.model.gguf_blocks import BLOCK_KINDS, decode_blocks

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


def tensor_weight(
    raw: np.ndarray, kind: str, shape: list[int], keep_blocks: bool = True
) -> torch.Tensor | BlockQuantized:
    """One GGUF tensor's data -> BlockQuantized (a 2-D weight of a kind gguf_blocks.py decodes)
    or float32 with exactly `gguf.quants.dequantize`'s values; a kind gguf cannot dequantize
    either is refused by name, never read as another."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if keep_blocks and kind in BLOCK_KINDS and len(shape) == 2:
        return decode_blocks(raw, kind, *shape)
    try:
        values = dequantize(raw, GGMLQuantizationType[kind])
    except (NotImplementedError, KeyError) as e:
        raise ValueError(f"GGUF tensor type {kind} cannot be loaded: neither decoded as blocks nor dequantized ({e})")
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute_weights)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def iterate_gguf_weights(path: str | Path, hf_config: object, keep_blocks: bool = True) -> Iterator[tuple[str, object]]:
    """Yield (HF name, float32 tensor or BlockQuantized). keep_blocks=False: every tensor as
    float32 (still one at a time)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        shape = [int(x) for x in reversed(t.shape.tolist())]  # ggml lists the fastest dimension first
        try:
            w = tensor_weight(t.data, t.tensor_type.name, shape, keep_blocks)
        except ValueError as e:
            raise ValueError(f"{path}: {t.name}: {e}") from None
        proj = name.split(".")[-2]
        if proj in heads and name.endswith(".weight"):
            order = unpermute_rows(shape[0], heads[proj])
            w = w.index_rows(order) if isinstance(w, BlockQuantized) else w[order]
        yield name, w
