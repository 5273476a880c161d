"""Seeded, reproducible workloads: mixed, uniform, shared-prefix, multi-turn chat, long-prompt, or JSONL.

The same (name, parameters, seed, tokenizer) always gives the same request list byte for byte
(``dumps``). Lengths are in tokens of the given counter (see ``tokens.py``). The one request
generator of the project: the load tester sends these over HTTP, the benchmarks in ``bench/``
feed them to the engine (``token_ids`` turns a prompt into the engine's input ids).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from loadtest import textgen
from loadtest.tokens import TokenCounter


@dataclass
class RequestSpec:
    id: str
    max_tokens: int  # forced output length (with ignore_eos)
    prompt: str | None = None  # /v1/completions
    messages: list[dict] | None = None  # /v1/chat/completions
    prompt_tokens: int = 0  # by the workload's counter (the server's usage wins)
    kind: str = "custom"
    session: str | None = None  # multi-turn: conversation id
    depends_on: str | None = None  # multi-turn: sent only after this request ended

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestSpec":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class WorkloadConfig:
    name: str = "mixed"  # mixed | uniform | shared-prefix | multi-turn | long-prompt | jsonl
    num_requests: int = 100
    seed: int = 0
    output_tokens: int | None = None  # override every request's output length
    path: str | None = None  # for jsonl
    prefix_tokens: int = 512  # shared-prefix
    num_prefixes: int = 1
    suffix_range: tuple[int, int] = (20, 60)
    turns: int = 4  # multi-turn
    long_range: tuple[int, int] = (1500, 3500)  # long-prompt
    prompt_range: tuple[int, int] = (20, 600)  # uniform: prompt tokens, drawn uniformly
    output_range: tuple[int, int] = (10, 500)  # uniform: output tokens, drawn uniformly
    extra: dict = field(default_factory=dict)


def mixed(n: int, rng: random.Random, counter: TokenCounter) -> list[RequestSpec]:
    kinds = textgen.MIXED_TASKS
    weights = [k.weight for k in kinds]
    specs = []
    for i in range(n):
        kind = rng.choices(kinds, weights)[0]
        target = rng.randint(*kind.prompt_range)
        out = rng.randint(*kind.output_range)
        head, tail = kind.frame(rng)
        prompt = textgen.fit(rng, counter, head, tail, target)
        specs.append(RequestSpec(f"mixed-{i}", out, prompt=prompt, prompt_tokens=counter.count(prompt), kind=kind.name))
    return specs


def uniform(cfg: WorkloadConfig, rng: random.Random, counter: TokenCounter) -> list[RequestSpec]:
    """Plain filler prompts (no task framing) whose length and output length are drawn uniformly
    from ``cfg.prompt_range`` and ``cfg.output_range``: the engine benchmarks' shape. A prompt is
    the drawn length or a few tokens under it (cut at a word)."""
    specs = []
    for i in range(cfg.num_requests):
        target = rng.randint(*cfg.prompt_range)
        out = rng.randint(*cfg.output_range)
        prompt = textgen.fit(rng, counter, "", "", target)
        specs.append(
            RequestSpec(f"uniform-{i}", out, prompt=prompt, prompt_tokens=counter.count(prompt), kind="uniform")
        )
    return specs


def shared_prefix(cfg: WorkloadConfig, rng: random.Random, counter: TokenCounter) -> list[RequestSpec]:
    prefixes = [
        textgen.fit(rng, counter, f"You are assistant number {g}. Follow this policy exactly:", "", cfg.prefix_tokens)
        for g in range(cfg.num_prefixes)
    ]
    specs = []
    for i in range(cfg.num_requests):
        g = i % cfg.num_prefixes
        suffix = textgen.fit(rng, counter, f"Request {i}:", "Answer:", rng.randint(*cfg.suffix_range))
        prompt = prefixes[g] + "\n\n" + suffix
        specs.append(
            RequestSpec(
                f"prefix-{i}",
                rng.randint(16, 48),
                prompt=prompt,
                prompt_tokens=counter.count(prompt),
                kind=f"prefix{g}",
            )
        )
    return specs


def multi_turn(cfg: WorkloadConfig, rng: random.Random, counter: TokenCounter) -> list[RequestSpec]:
    """Each turn resends the whole conversation; the assistant's earlier replies are synthetic
    text of the length that turn asked for (so the request list does not depend on the server)."""
    turns = max(1, cfg.turns)
    sessions = max(1, -(-cfg.num_requests // turns))
    by_turn: list[list[RequestSpec]] = [[] for _ in range(turns)]
    for s in range(sessions):
        system = textgen.fit(rng, counter, "You are a helpful assistant. Background:", "", rng.randint(30, 80))
        messages: list[dict] = [{"role": "system", "content": system}]
        prev = None
        for t in range(turns):
            user = textgen.fit(rng, counter, f"Turn {t}:", "What do you think?", rng.randint(20, 80))
            messages = messages + [{"role": "user", "content": user}]
            out = rng.randint(40, 120)
            rid = f"chat-{s}-{t}"
            by_turn[t].append(
                RequestSpec(
                    rid,
                    out,
                    messages=list(messages),
                    prompt_tokens=sum(counter.count(m["content"]) for m in messages),
                    kind=f"turn{t}",
                    session=f"chat-{s}",
                    depends_on=prev,
                )
            )
            reply = textgen.fit(rng, counter, "", "", out)
            messages = messages + [{"role": "assistant", "content": reply}]
            prev = rid
    specs = [spec for turn in by_turn for spec in turn]  # round-robin: all first turns first
    return specs[: cfg.num_requests] if len(specs) > cfg.num_requests else specs


def long_prompt(cfg: WorkloadConfig, rng: random.Random, counter: TokenCounter) -> list[RequestSpec]:
    specs = []
    for i in range(cfg.num_requests):
        prompt = textgen.fit(
            rng,
            counter,
            "Read the document and answer the final question. Document:",
            "Question: what is the main point?",
            rng.randint(*cfg.long_range),
        )
        specs.append(
            RequestSpec(
                f"long-{i}",
                rng.randint(32, 128),
                prompt=prompt,
                prompt_tokens=counter.count(prompt),
                kind="long_prompt",
            )
        )
    return specs


def read_jsonl(path: str, counter: TokenCounter) -> list[RequestSpec]:
    """Lines of {"prompt"|"messages", "max_tokens"|"output_tokens", optional id/kind/...}."""
    specs = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            d = json.loads(line)
            d.setdefault("id", f"req-{i}")
            if "max_tokens" not in d:
                d["max_tokens"] = int(d.pop("output_tokens", 128))
            if "prompt" not in d and "messages" not in d:
                raise ValueError(f"{path}:{i + 1}: needs 'prompt' or 'messages'")
            spec = RequestSpec.from_dict(d)
            if not spec.prompt_tokens:
                text = spec.prompt if spec.prompt is not None else " ".join(m["content"] for m in spec.messages)
                spec.prompt_tokens = counter.count(text)
            specs.append(spec)
    return specs


def build(cfg: WorkloadConfig, counter: TokenCounter) -> list[RequestSpec]:
    rng = random.Random(cfg.seed)
    if cfg.name == "mixed":
        specs = mixed(cfg.num_requests, rng, counter)
    elif cfg.name == "uniform":
        specs = uniform(cfg, rng, counter)
    elif cfg.name == "shared-prefix":
        specs = shared_prefix(cfg, rng, counter)
    elif cfg.name == "multi-turn":
        specs = multi_turn(cfg, rng, counter)
    elif cfg.name == "long-prompt":
        specs = long_prompt(cfg, rng, counter)
    elif cfg.name == "jsonl":
        if not cfg.path:
            raise ValueError("the jsonl workload needs a path")
        specs = read_jsonl(cfg.path, counter)
    else:
        raise ValueError(f"unknown workload {cfg.name!r}")
    if cfg.output_tokens:
        for s in specs:
            s.max_tokens = cfg.output_tokens
    return specs


def token_ids(spec: RequestSpec, tokenizer, length: int | None = None) -> list[int]:
    """The request's prompt as token ids of ``tokenizer`` (a transformers tokenizer, no special
    tokens), for benchmarks that feed the engine ids. Chat messages are joined by newlines (no
    chat template). ``length``: exactly that many ids, the prompt's cut, or repeated from its start
    to fill what the word-boundary cut left short (for fixed-shape batches)."""
    text = spec.prompt if spec.prompt is not None else "\n".join(m["content"] for m in spec.messages or ())
    ids = tokenizer.encode(text, add_special_tokens=False)
    if length is None:
        return ids
    if not ids:
        raise ValueError(f"{spec.id}: empty prompt, cannot fill {length} tokens")
    return (ids * -(-length // len(ids)))[:length]


def dumps(specs: list[RequestSpec]) -> str:
    """JSONL text of a request list (the byte-for-byte reproducibility check uses this)."""
    return "".join(json.dumps(s.to_dict(), sort_keys=True) + "\n" for s in specs)
