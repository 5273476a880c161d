"""The watermark's green lists (engine/watermark.py) as a [rows, vocab] mask for a step's sampled
rows: the hash of engine/watermark.py on int64 tensors, so the sampler marks exactly the tokens
the detector counts as green."""

from __future__ import annotations

import torch

from engine.watermark import green_bound, green_hash, green_seed


def green_mask(prev: torch.Tensor, keys: torch.Tensor, gammas: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] bool: each row's green list given its previous token `prev[r]`, key and gamma."""
    seed = green_seed(keys, prev)
    tokens = torch.arange(vocab, dtype=torch.int64, device=prev.device)
    h = green_hash(seed.unsqueeze(1), tokens.unsqueeze(0))
    return h.to(torch.float64) < green_bound(gammas.to(torch.float64)).unsqueeze(1)
