"""Sampler: logits [B, V] -> one token id per row (+ logprobs of the raw distribution).

Order: raw logprobs, logit_bias, the structured-output mask, min_tokens blocking, repetition
penalty, presence/frequency penalties, the watermark's green-list bonus, temperature, top-k, top-p, typical-p, min-p, sample. Greedy rows take argmax (ties -> lowest id).
Random rows use the exponential race argmax(p / q), q ~ Exp(1): a seeded row draws q from its
own generator only, so its result does not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels.cpu_ops import load_cpu_ops
from engine.layers.watermark_mask import green_mask
from engine.outputs import TokenLogprob
from engine.runner import host_to_device
from engine.runner.sampling_metadata import SamplingMetadata

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Per row: [logprob of the sampled token] or None when the request did not ask for logprobs.
    # A list per row to match ModelRunnerOutput.logprobs (several tokens per step later).
    logprobs: list[list[TokenLogprob] | None]


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        md = metadata
        if not md.needs_processing and md.max_num_logprobs is None:
            # Plain greedy: argmax of the raw logits (a float32 copy holds the same values).
            return SamplerOutput(sampled_token_ids=argmax_rows(logits), logprobs=[None] * md.batch_size)
        # float32 always; a fresh copy because the steps below work in place.
        logits = logits.to(torch.float32, copy=True)
        # Raw logprobs come before any processing: they are what users compare to transformers.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None

        if not md.needs_processing:
            sampled = argmax_rows(logits)
        else:
            apply_logit_bias(logits, md)
            apply_allowed_tokens(logits, md)
            apply_min_tokens(logits, md)
            apply_penalties(logits, md)
            apply_watermark(logits, md)
            if md.all_greedy:
                sampled = argmax_rows(logits)
            else:
                greedy = None if md.all_random else argmax_rows(logits)
                logits.div_(md.temperature.unsqueeze(1))
                apply_top_k_top_p(logits, md.top_k, md.top_p)
                apply_typical_p(logits, md.typical_p)
                probs = torch.softmax(logits, dim=-1)
                apply_min_p(probs, md.min_p)
                sampled = exponential_race(probs, md)
                if greedy is not None:
                    sampled = torch.where(md.greedy_mask, greedy, sampled)

        logprobs: list[list[TokenLogprob] | None] = [None] * md.batch_size
        if raw_logprobs is not None:
            rows = [i for i, k in enumerate(md.num_logprobs) if k is not None]
            idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            entries = to_token_logprobs(raw_logprobs[idx], sampled[idx], [md.num_logprobs[i] for i in rows])
            for i, e in zip(rows, entries):
                logprobs[i] = [e]
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a [B, V] CPU matrix through the C++ op when built (torch's
    scans a bf16 [256, 49152] in ~22 ms, the op in ~1 ms); same result, ties to the lowest id."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and x.stride(1) == 1:
        ops = load_cpu_ops()
        if ops is not None:
            return ops.argmax_rows(x)
    return x.argmax(dim=-1)


def apply_logit_bias(logits: torch.Tensor, md: SamplingMetadata) -> None:
    if md.logit_bias is not None:
        rows, cols, vals = md.logit_bias
        keep = cols < logits.shape[1]
        logits.index_put_((rows[keep], cols[keep]), vals[keep], accumulate=True)


def apply_allowed_tokens(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """-inf for every token a row's bitmask leaves out (bit t % 32 of word t // 32)."""
    if md.allowed_tokens is None:
        return
    rows, words = md.allowed_tokens
    v = logits.shape[1]
    # Little-endian words: byte order and numpy's little bit order give token order.
    bits = np.unpackbits(words.cpu().numpy().view(np.uint8), axis=1, bitorder="little")
    if bits.shape[1] < v:  # a bitmask narrower than the logits allows none of the rest
        bits = np.pad(bits, ((0, 0), (0, v - bits.shape[1])))
    # 0 where allowed, -inf where not, without a branch per token (a masked fill of a [32, 49152]
    # batch took ~4 ms, this ~0.7): (b * M - M) * 1e30 is 0 for b = 1 and overflows to -inf for 0.
    big = torch.finfo(torch.float32).max
    penalty = torch.from_numpy(bits[:, :v]).to(logits.device, torch.float32).mul_(big).sub_(big).mul_(1e30)
    if rows.shape[0] == logits.shape[0]:  # every row constrained (rows are in order)
        logits.add_(penalty)
    else:
        logits[rows] += penalty


def apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> None:
    if md.min_tokens_block is not None:
        rows, cols = md.min_tokens_block
        keep = cols < logits.shape[1]  # an id outside the model vocab cannot be sampled anyway
        logits[rows[keep], cols[keep]] = _NEG_INF


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    if md.no_penalties:
        return
    b, v = logits.shape
    out_counts = _counts(md.output_token_ids, b, v)
    if md.prompt_token_ids is not None:
        # HF repetition penalty over every token seen (prompt + output): shrink towards 0 side.
        seen = (_counts(md.prompt_token_ids, b, v) > 0) | (out_counts > 0)
        rp = md.repetition_penalty.unsqueeze(1).expand(b, v)
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits.copy_(torch.where(seen, penalized, logits))
    # OpenAI semantics over output tokens only.
    logits.sub_(md.frequency_penalty.unsqueeze(1) * out_counts)
    logits.sub_(md.presence_penalty.unsqueeze(1) * (out_counts > 0).to(logits.dtype))


def _counts(token_ids: torch.Tensor, b: int, v: int) -> torch.Tensor:
    """[B, L] ids padded with -1 -> [B, V] float32 occurrence counts (pad goes to column V)."""
    ids = token_ids.masked_fill(token_ids < 0, v).clamp_max(v)
    counts = torch.zeros(b, v + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :v]


def apply_watermark(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """+delta on each watermarked row's green list (engine/watermark.py)."""
    if md.watermark is None:
        return
    rows, prev, keys, gammas, deltas = md.watermark
    green = green_mask(prev, keys, gammas, logits.shape[1])
    logits[rows] += green.to(logits.dtype) * deltas.unsqueeze(1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """Mask (in place) tokens outside top-k and outside the top-p nucleus, with one sort."""
    if top_k is None and top_p is None:
        return
    v = logits.shape[1]
    values, order = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(values, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, v).clamp(1, v)
        kth = values.gather(1, (k - 1).unsqueeze(1))
        remove |= values < kth  # ties with the k-th value are kept
    if top_p is not None:
        probs = torch.softmax(values.masked_fill(remove, _NEG_INF), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        # Keep the smallest prefix reaching top_p; rows with top_p == 1 are left alone (rounding).
        remove |= (before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    logits.masked_fill_(remove.scatter(1, order, remove), _NEG_INF)


def apply_typical_p(logits: torch.Tensor, typical_p: torch.Tensor | None) -> None:
    """Locally typical sampling (Meister et al. 2022, as transformers' TypicalLogitsWarper), per
    row: keep the tokens whose surprise is closest to the distribution's entropy until they hold
    `typical_p` of the mass (at least one); rows with typical_p == 1 are left alone."""
    if typical_p is None:
        return
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    entropy = -(logp * p).nansum(dim=-1, keepdim=True)
    distance = (-logp - entropy).abs()
    sorted_dist, order = distance.sort(dim=-1)
    cumulative = logits.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < typical_p.unsqueeze(1)).sum(dim=1).clamp_(max=logits.shape[1] - 1)
    remove = sorted_dist > sorted_dist.gather(1, last.unsqueeze(1))
    remove[:, 0] = False
    remove &= (typical_p < 1.0).unsqueeze(1)
    logits.masked_fill_(remove.scatter(1, order, remove), _NEG_INF)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor | None) -> None:
    if min_p is None:
        return
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    probs.masked_fill_(probs < threshold, 0.0)


def exponential_race(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """argmax(p / q), q ~ Exp(1): a sample from p. Greedy rows draw nothing (their generator
    state stays untouched); rows without a generator share torch's default one."""
    b, v = probs.shape
    q = torch.ones_like(probs)
    greedy = md.greedy or [False] * b
    shared = [i for i in range(b) if not greedy[i] and md.generators[i] is None]
    if shared:
        noise = torch.empty(len(shared), v, dtype=torch.float32, device=probs.device).exponential_()
        q[host_to_device.tensor(shared, torch.int64, probs.device)] = noise
    for i, g in enumerate(md.generators):
        if g is not None and not greedy[i]:
            if g.device.type != probs.device.type:  # torch's own error names neither the row nor the fix
                raise ValueError(
                    f"row {i}: generator on {g.device}, logits on {probs.device}; "
                    "seeded generators must live on the logits' device"
                )
            q[i].exponential_(generator=g)
    # q == 0 would turn a zero-probability token into 0/0 = nan (which argmax picks).
    return argmax_rows(probs.div_(q.clamp_min_(torch.finfo(torch.float32).tiny)))


def to_token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """Rows of log-probabilities [N, V] -> TokenLogprob of token_ids[n] with its top-ks[n]."""
    if logprobs.shape[0] == 0:
        return []
    chosen = logprobs.gather(1, token_ids.view(-1, 1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    max_k = max(ks)
    top_vals, top_ids = logprobs.topk(max_k, dim=-1) if max_k > 0 else (None, None)
    chosen_l, ranks_l, ids_l = chosen.view(-1).tolist(), ranks.tolist(), token_ids.tolist()
    tv = top_vals.tolist() if top_vals is not None else None
    ti = top_ids.tolist() if top_ids is not None else None
    out = []
    for n, k in enumerate(ks):
        top = list(zip(ti[n][:k], tv[n][:k])) if k > 0 else []
        out.append(TokenLogprob(token_id=ids_l[n], logprob=chosen_l[n], rank=ranks_l[n], top=top))
    return out


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor | list[int], k: int
) -> list[TokenLogprob]:
    """Logprob of each target token under the logits at the position before it ([T, V], [T])."""
    targets = torch.as_tensor(target_token_ids, dtype=torch.int64, device=logits.device)
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return to_token_logprobs(logprobs, targets, [k] * targets.shape[0])
