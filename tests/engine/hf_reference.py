"""Reference outputs from Hugging Face transformers, one prompt at a time (no padding)."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None
) -> tuple[list[int], list[float]]:
    """Greedy token ids and the raw logprob of each chosen token."""
    out = model.generate(
        torch.tensor([prompt_ids], device=model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if eos_token_id is not None else 0,
    )
    ids = out.sequences[0, len(prompt_ids) :].tolist()
    lps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, ids)]
    return ids, lps


@torch.inference_mode()
def hf_prompt_logprobs(model, prompt_ids: list[int]) -> list[float]:
    logits = model(torch.tensor([prompt_ids], device=model.device)).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[i, prompt_ids[i + 1]].item() for i in range(len(prompt_ids) - 1)]
