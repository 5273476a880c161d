"""Batched sampling state for one step, built once by the model runner from per-request state.

Everything the sampler needs travels in this one object (ARCHITECTURE.md, rule 7). Tensors that only some
features need (penalties, top-k/p, min-p, min_tokens blocking) are built only when a request in
the batch uses them, so the common all-greedy batch is just an argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.runner.host_to_device import tensor, to_device
from engine.sampling_params import SamplingParams

_PAD = -1  # padding of the token-id tables; mapped to a spare column by the sampler


@dataclass
class SamplingMetadata:
    batch_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [B] bool, only for mixed batches
    temperature: torch.Tensor | None  # [B] float32, greedy rows set to 1.0 (never divided by 0)
    top_k: torch.Tensor | None  # [B] int64, 0 = disabled
    top_p: torch.Tensor | None  # [B] float32
    typical_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    # Per-row generator; None rows draw from the shared one (torch's default RNG).
    generators: list[torch.Generator | None] = field(default_factory=list)
    # Penalties (None when no request in the batch uses any).
    repetition_penalty: torch.Tensor | None = None  # [B] float32
    presence_penalty: torch.Tensor | None = None  # [B] float32
    frequency_penalty: torch.Tensor | None = None  # [B] float32
    prompt_token_ids: torch.Tensor | None = None  # [B, Lp] int64, padded with -1
    output_token_ids: torch.Tensor | None = None  # [B, Lo] int64, padded with -1
    # (row, token) pairs whose logits are set to -inf because output length < min_tokens.
    min_tokens_block: tuple[torch.Tensor, torch.Tensor] | None = None
    # logit_bias: (rows, token ids, biases) added to the logits before anything else.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Watermark: (rows, previous tokens, keys, gammas, deltas), each [R] (engine/watermark.py).
    watermark: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Structured outputs: (rows, [R, ceil(V/32)] int32 bitmask of the tokens each may take).
    allowed_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    # Per row: greedy or not, on the host (reading greedy_mask back would wait for the device).
    greedy: list[bool] = field(default_factory=list)
    # Logprobs: per-row k (None = not requested) and the batch maximum (None = nobody asked).
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalty is None

    @property
    def needs_processing(self) -> bool:
        """False when sampled ids are just argmax of the raw logits."""
        return not (
            self.all_greedy
            and self.no_penalties
            and self.min_tokens_block is None
            and self.logit_bias is None
            and self.allowed_tokens is None
            and self.watermark is None
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None] | None = None,
        eos_token_ids: list[int | list[int] | None] | None = None,
        device: torch.device | str = "cpu",
        bitmasks: list[torch.Tensor | None] | None = None,
    ) -> "SamplingMetadata":
        """`bitmasks`: per row, the allowed tokens of a structured output ([ceil(V/32)] int32)
        or None."""
        b = len(params)
        generators = list(generators) if generators is not None else [None] * b
        eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else [None] * b
        assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == len(eos_token_ids) == b

        greedy = [p.greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)

        def f32(values: list[float]) -> torch.Tensor:
            return tensor(values, torch.float32, device)

        temperature = top_k = top_p = typical_p = min_p = greedy_mask = None
        if not all_greedy:
            temperature = f32([1.0 if g else p.temperature for p, g in zip(params, greedy)])
            if not all_random:
                greedy_mask = tensor(greedy, torch.bool, device)
            # Filters only matter for random rows; greedy rows get neutral values.
            if any(p.top_k > 0 and not g for p, g in zip(params, greedy)):
                top_k = tensor([0 if g else p.top_k for p, g in zip(params, greedy)], torch.int64, device)
            if any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)):
                top_p = f32([1.0 if g else p.top_p for p, g in zip(params, greedy)])
            if any(p.typical_p < 1.0 and not g for p, g in zip(params, greedy)):
                typical_p = f32([1.0 if g else p.typical_p for p, g in zip(params, greedy)])
            if any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)):
                min_p = f32([0.0 if g else p.min_p for p, g in zip(params, greedy)])

        md = cls(
            batch_size=b,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            typical_p=typical_p,
            min_p=min_p,
            generators=generators,
            greedy=greedy,
        )

        if any(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            md.repetition_penalty = f32([p.repetition_penalty for p in params])
            md.presence_penalty = f32([p.presence_penalty for p in params])
            md.frequency_penalty = f32([p.frequency_penalty for p in params])
            # The prompt table is only needed for the repetition penalty (prompt + output seen).
            if any(p.repetition_penalty != 1.0 for p in params):
                md.prompt_token_ids = _pad(prompt_token_ids, device)
            md.output_token_ids = _pad(output_token_ids, device)

        rows: list[int] = []
        cols: list[int] = []
        for i, (p, out, eos) in enumerate(zip(params, output_token_ids, eos_token_ids)):
            if len(out) >= p.min_tokens:
                continue
            blocked = set(p.stop_token_ids)
            if eos is not None:  # blocked even with ignore_eos: harmless and simpler
                blocked.update([eos] if isinstance(eos, int) else eos)
            rows += [i] * len(blocked)
            cols += sorted(blocked)
        if rows:
            md.min_tokens_block = (
                tensor(rows, torch.int64, device),
                tensor(cols, torch.int64, device),
            )

        bias = [(i, t, v) for i, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
        if bias:
            r, t, v = zip(*bias)
            md.logit_bias = (
                tensor(r, torch.int64, device),
                tensor(t, torch.int64, device),
                f32(list(v)),
            )
        marked = [i for i, p in enumerate(params) if p.watermark is not None]
        if marked:  # the previous token: the last output, or the prompt's last before any
            prev = [(output_token_ids[i] or prompt_token_ids[i])[-1] for i in marked]
            wms = [params[i].watermark for i in marked]
            md.watermark = (
                tensor(marked, torch.int64, device),
                tensor(prev, torch.int64, device),
                tensor([w.key for w in wms], torch.int64, device),
                tensor([w.gamma for w in wms], torch.float64, device),
                f32([w.delta for w in wms]),
            )
        masked = [i for i, m in enumerate(bitmasks or []) if m is not None]
        if masked:
            md.allowed_tokens = (
                tensor(masked, torch.int64, device),
                to_device(torch.stack([bitmasks[i] for i in masked]), device),
            )

        md.num_logprobs = [p.logprobs for p in params]
        requested = [k for k in md.num_logprobs if k is not None]
        md.max_num_logprobs = max(requested) if requested else None
        return md


def _pad(rows: list[list[int]], device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), _PAD, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return to_device(out, device)
