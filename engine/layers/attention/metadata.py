"""Attention metadata for one step, built once by the model runner and read by every layer.

Token order in a step: all decode tokens first (one per request), then prefill chunks.
Decode requests are grouped into length buckets so padding to the longest context in a
group stays small; each bucket's block table and mask are built once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DecodeBucket:
    start: int  # first token row in the batch
    end: int
    flat_block_ids: torch.Tensor  # [b * max_blocks] (padded with block 0)
    max_blocks: int
    mask: torch.Tensor  # [b, 1, max_blocks * block_size] bool, True = attend


@dataclass
class PrefillChunk:
    start: int  # first token row in the batch
    num_new: int  # query tokens this step
    num_context: int  # tokens already in the cache before this step
    block_ids: torch.Tensor  # blocks covering num_context + num_new tokens
    mask: torch.Tensor | None  # [num_new, total] bool, None when no context (plain causal)


@dataclass
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decode_tokens: int
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    # Whole decode batch for kernels that read the paged cache directly (rows 0..num_decode_tokens).
    decode_block_table: torch.Tensor | None = None  # [Bd, max_blocks] int32
    decode_seq_lens: torch.Tensor | None = None  # [Bd] int32, including the new token
    decode_info: torch.Tensor | None = None  # [Bd, 3] int32 as prefill_info; filled by a backend that wants it
    prefills: list[PrefillChunk] = field(default_factory=list)
    # All prefill chunks at once for kernels that read the paged cache directly.
    prefill_block_table: torch.Tensor | None = None  # [C, max_blocks] int32
    prefill_info: torch.Tensor | None = None  # [C, 3] int32: first row, new tokens, cached tokens
    prefill_max_new: int = 0  # longest chunk's new tokens (sizes a kernel grid without a device read)
