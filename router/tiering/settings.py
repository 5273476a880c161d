"""The tier routing settings (pydantic, read by `AppConfig.tier_routing`): a tier alias's rules,
classifier and hint header, validated where the config is."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TierRule(BaseModel):
    """A rule of a tier's routing: a request for which every condition set here holds starts at
    `pool` (the rules are tried in order; the first that holds wins)."""

    model_config = ConfigDict(extra="forbid")

    pool: str = Field(min_length=1, description="The pool of the tier to start at.")
    min_prompt_tokens: int | None = Field(None, ge=0, description="Prompt at least this long (tokens).")
    max_prompt_tokens: int | None = Field(None, ge=0, description="Prompt at most this long (tokens).")
    min_max_tokens: int | None = Field(
        None, ge=1, description="max_tokens at least this (a request that sets none matches)."
    )
    tools: bool | None = Field(None, description="The request offers tools (true) or none (false).")
    response_format: bool | None = Field(
        None, description="The request asks for structured output: a JSON schema or object, regex, choice, grammar."
    )


class TierRouting(BaseModel):
    """How a tier alias picks the pool a request starts at (router/tiering/policy.py): the
    `x-orbital-tier` hint header, then `rules`, then the learned `classifier`, else the first pool.
    Overflow then moves on to the tier's later pools."""

    model_config = ConfigDict(extra="forbid")

    rules: list[TierRule] = Field([], description="Tried in order; the first whose conditions all hold picks.")
    classifier: str | None = Field(
        None, description="A classifier file from `python -m router.tiering train`, read by the router replicas."
    )
    classifier_threshold: float = Field(
        0.5,
        gt=0,
        le=1,
        description="The smallest pool whose probability plus the smaller pools' reaches this: lower is cheaper.",
    )
    allow_hint: bool = Field(True, description="Take the client's `x-orbital-tier` header (a pool of the tier).")
