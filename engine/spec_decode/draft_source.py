"""Where a draft model comes from: a local model sharing the target's tokenizer ("draft"), or
the target's own weights ("self": its first N layers with its final norm and LM head, shared
with the target when it runs in this process, or a copy of its weights in int8).

The draft always runs at tp=1 in the engine's process, on the engine's own model code, runner
and KV pieces (its own pool), whatever the target's tensor-parallel degree.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.errors import InvalidRequestError
from engine.model_config import ModelConfig, build_model_config

if TYPE_CHECKING:
    from engine.config import CacheConfig
    from engine.runner.executor import Executor
    from engine.spec_decode.config import SpeculativeConfig
    from engine.spec_decode.draft_model import DraftModelProposer


def _structure_copy(module: nn.Module) -> nn.Module:
    """New module objects (so their attention layers bind their own KV cache) over the very same
    parameters, buffers and kernels: no weight is copied."""
    clone = copy.copy(module)
    clone._modules = {name: _structure_copy(child) for name, child in module._modules.items()}
    return clone


def first_layers_of(target: nn.Module, num_layers: int) -> nn.Module:
    """The target's embedding, first `num_layers` decoder layers, final norm and LM head."""
    draft = _structure_copy(target)
    draft.model.layers = nn.ModuleList(list(draft.model.layers)[:num_layers])
    for attn in draft.attention_layers():
        attn.kv_cache = None
    return draft


def check_same_vocab(draft: ModelConfig, target: ModelConfig) -> None:
    """Draft tokens are target token ids: the vocabularies must be the same, id for id."""
    from transformers import AutoTokenizer

    if draft.vocab_size != target.vocab_size:
        raise InvalidRequestError(
            f"draft model {draft.model_dir} has vocab_size {draft.vocab_size}, the target {target.vocab_size}: "
            "a draft must share the target's tokenizer"
        )
    try:
        draft_vocab = AutoTokenizer.from_pretrained(draft.model_dir).get_vocab()
    except (OSError, ValueError) as e:
        raise InvalidRequestError(
            f"draft model {draft.model_dir} has no tokenizer to check against the target's ({e}); "
            "save the target's tokenizer files next to the draft's weights"
        ) from None
    if draft_vocab != AutoTokenizer.from_pretrained(target.model_dir).get_vocab():
        raise InvalidRequestError(f"draft model {draft.model_dir} has a different tokenizer vocabulary than the target")


def build_draft(
    spec: SpeculativeConfig, target: ModelConfig, device: torch.device | str, target_model: nn.Module | None
) -> tuple[ModelConfig, nn.Module | None]:
    """The draft's model config and, for self-drafting, its model (None: the runner loads it).
    `target_model`: the target's model when it runs unsharded in this process (tp=1)."""
    if spec.method == "draft":
        mc = build_model_config(
            spec.model, target.dtype, torch.device(device), target.max_model_len, None, spec.draft_quantization
        )
        check_same_vocab(mc, target)
        return mc, None
    layers = target.num_layers if spec.draft_layers is None else spec.draft_layers
    if layers > target.num_layers:
        raise InvalidRequestError(f"draft_layers={layers} but the target has {target.num_layers} layers")
    quant = spec.draft_quantization or target.quantization
    if spec.draft_quantization is None and layers == target.num_layers:
        raise InvalidRequestError('method "self" needs draft_layers < the target\'s layers or draft_quantization')
    hf_config = copy.deepcopy(target.hf_config)
    hf_config.num_hidden_layers = layers
    mc = dataclasses.replace(target, hf_config=hf_config, quantization=quant)
    if target_model is not None and quant == target.quantization:
        return mc, first_layers_of(target_model, layers)  # shared weights
    from engine.model.loader import load_model

    # Not shareable (the target is sharded in other processes, or the draft is quantized): load
    # the target's checkpoint at tp=1 and keep the first layers.
    model = load_model(
        target.model_dir, target.hf_config, target.dtype, torch.device(device), target.max_model_len, quant
    )
    return mc, first_layers_of(model, layers) if layers < target.num_layers else model


def build_draft_proposer(
    spec: SpeculativeConfig,
    target: ModelConfig,
    cache: CacheConfig,
    max_num_seqs: int,
    device: torch.device | str,
    executor: Executor,
) -> DraftModelProposer:
    """The draft model's runner on its own KV pool (as many blocks as the target's unless
    `draft_num_blocks` says), with its step cost measured when k is adaptive."""
    from engine.runner.executor import InProcessExecutor
    from engine.runner.model_runner import ModelRunner
    from engine.spec_decode.draft_model import DraftModelProposer

    # The target's model is shareable when it runs whole in this process (tp=1).
    shared = executor.runner.model if isinstance(executor, InProcessExecutor) else None
    mc, model = build_draft(spec, target, device, shared)
    # The draft's own pool has no prefix cache, so no offload tier either.
    draft_cache = dataclasses.replace(
        cache, num_blocks=spec.draft_num_blocks or executor.num_blocks, kv_offload_bytes=0
    )
    draft_runner = ModelRunner(mc, draft_cache, device)
    draft_runner.load_model(model)
    return DraftModelProposer(
        draft_runner, draft_cache.num_blocks, max_num_seqs, spec.num_speculative_tokens, measure=spec.adaptive
    )
