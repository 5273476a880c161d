"""The learned tier classifier, RouteLLM's idea at its smallest: multinomial logistic regression
over the prompt's hashed word uni- and bigrams and four request features, trained from labelled
requests (the smallest pool whose answer was good enough) and saved as JSON beside the config.

The choice trades cost for quality with one knob, `threshold`: the smallest pool whose
probability, added to the smaller pools', reaches it. 0.5 is the argmax of a two-pool tier;
lower sends more to small pools, higher more to large ones."""

from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from router.tiering.features import RequestFeatures

FORMAT = "orbital-tier-classifier/1"
HASH_DIM = 4096
EXTRA = 4  # log prompt tokens, log max_tokens, tools, response_format
DIM = HASH_DIM + EXTRA
NO_BUDGET = 4096  # what a request without max_tokens counts as
_WORD = re.compile(r"\w+|[^\w\s]")


def feature_vector(f: RequestFeatures) -> torch.Tensor:
    v = torch.zeros(DIM)
    words = _WORD.findall(f.text.lower())
    for gram in words + [f"{a} {b}" for a, b in zip(words, words[1:])]:
        v[zlib.crc32(gram.encode()) % HASH_DIM] += 1.0  # crc32: the same bucket in every process
    norm = v[:HASH_DIM].norm()
    if norm > 0:
        v[:HASH_DIM] /= norm
    v[HASH_DIM] = math.log1p(f.prompt_tokens) / 8
    v[HASH_DIM + 1] = math.log1p(f.max_tokens if f.max_tokens is not None else NO_BUDGET) / 8
    v[HASH_DIM + 2] = float(f.has_tools)
    v[HASH_DIM + 3] = float(f.has_response_format)
    return v


@dataclass
class TierClassifier:
    pools: list[str]  # smallest first: the tier's order
    weight: torch.Tensor  # [len(pools), DIM]
    bias: torch.Tensor  # [len(pools)]
    threshold: float = 0.5

    def probabilities(self, f: RequestFeatures) -> list[float]:
        return torch.softmax(self.weight @ feature_vector(f) + self.bias, 0).tolist()

    def choose(self, f: RequestFeatures) -> str:
        total = 0.0
        for pool, p in zip(self.pools, self.probabilities(f)):
            total += p
            if total >= self.threshold:
                return pool
        return self.pools[-1]

    def save(self, path: str | Path) -> None:
        data = {
            "format": FORMAT,
            "pools": self.pools,
            "hash_dim": HASH_DIM,
            "threshold": self.threshold,
            "bias": self.bias.tolist(),
            "weight": [[round(x, 6) for x in row] for row in self.weight.tolist()],
        }
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path, threshold: float | None = None) -> TierClassifier:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT or data.get("hash_dim") != HASH_DIM:
            raise ValueError(
                f"{path}: not a tier classifier of format {FORMAT} (train one with python -m router.tiering)"
            )
        weight, bias = torch.tensor(data["weight"]), torch.tensor(data["bias"])
        if weight.shape != (len(data["pools"]), DIM) or bias.shape != (len(data["pools"]),):
            raise ValueError(f"{path}: weights of shape {tuple(weight.shape)} for pools {data['pools']}")
        return cls(list(data["pools"]), weight, bias, data["threshold"] if threshold is None else threshold)


def train(
    rows: list[tuple[RequestFeatures, str]], pools: list[str], steps: int = 300, l2: float = 1e-4, seed: int = 0
) -> TierClassifier:
    """Fit on (features, label) rows; labels must be names in `pools` (smallest first)."""
    unknown = sorted({label for _, label in rows} - set(pools))
    if unknown:
        raise ValueError(f"labels {unknown} are not pools of {pools}")
    if not rows:
        raise ValueError("no training rows")
    gen = torch.Generator().manual_seed(seed)
    x = torch.stack([feature_vector(f) for f, _ in rows])
    y = torch.tensor([pools.index(label) for _, label in rows])
    weight = (torch.randn(len(pools), DIM, generator=gen) * 0.01).requires_grad_()
    bias = torch.zeros(len(pools), requires_grad=True)
    opt = torch.optim.Adam([weight, bias], lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight.T + bias, y) + l2 * weight.pow(2).sum()
        loss.backward()
        opt.step()
    return TierClassifier(list(pools), weight.detach(), bias.detach())


def accuracy(model: TierClassifier, rows: list[tuple[RequestFeatures, str]]) -> float:
    return sum(model.choose(f) == label for f, label in rows) / max(len(rows), 1)
