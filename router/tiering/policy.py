"""Which pool of a tier a request starts at: the client's hint header, then the operator's rules
(the first whose every condition holds), then the learned classifier, else the tier's first pool.
Overflow (model_pools.py) then moves on to the later pools, never back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.tiering.classifier import TierClassifier
from router.tiering.features import RequestFeatures

if TYPE_CHECKING:
    from router.tiering.settings import TierRouting, TierRule

HINT_HEADER = "x-orbital-tier"  # names the pool of the tier a request starts at
REASONS = ("hint", "rule", "classifier", "default")


@dataclass(frozen=True)
class TierDecision:
    start: int  # index in the tier of the first pool to try
    reason: str  # one of REASONS


class TierHintError(ValueError):
    """The hint header names no pool of the tier (a 400 naming the header)."""


def rule_matches(rule: TierRule, f: RequestFeatures) -> bool:
    checks = (
        rule.min_prompt_tokens is None or f.prompt_tokens >= rule.min_prompt_tokens,
        rule.max_prompt_tokens is None or f.prompt_tokens <= rule.max_prompt_tokens,
        rule.min_max_tokens is None or f.max_tokens is None or f.max_tokens >= rule.min_max_tokens,
        rule.tools is None or f.has_tools == rule.tools,
        rule.response_format is None or f.has_response_format == rule.response_format,
    )
    return all(checks)


class TierPolicy:
    """One alias's policy: `tier` is its pools in order (smallest first)."""

    def __init__(self, alias: str, tier: list[str], routing: TierRouting | None = None) -> None:
        self.alias, self.tier, self.routing = alias, list(tier), routing
        self.classifier: TierClassifier | None = None
        if routing is not None and routing.classifier:
            self.classifier = TierClassifier.load(routing.classifier, routing.classifier_threshold)
            extra = [p for p in self.classifier.pools if p not in self.tier]
            if extra:
                raise ValueError(f"{routing.classifier}: pools {extra} are not in tier {alias!r} {self.tier}")

    @property
    def needs_features(self) -> bool:
        return self.routing is not None and bool(self.routing.rules or self.classifier)

    def decide(self, features: RequestFeatures | None, hint: str | None) -> TierDecision:
        if hint:
            if self.routing is not None and not self.routing.allow_hint:
                raise TierHintError(f"{HINT_HEADER}: the tier {self.alias!r} takes no hint")
            if hint not in self.tier:
                raise TierHintError(f"{HINT_HEADER}: {hint!r} is not a pool of tier {self.alias!r} {self.tier}")
            return TierDecision(self.tier.index(hint), "hint")
        if features is not None and self.routing is not None:
            for rule in self.routing.rules:
                if rule_matches(rule, features):
                    return TierDecision(self.tier.index(rule.pool), "rule")
            if self.classifier is not None:
                return TierDecision(self.tier.index(self.classifier.choose(features)), "classifier")
        return TierDecision(0, "default")
