"""Seeded synthetic text: word lists and task templates, fitted to a token budget. No data sets."""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.tokens import TokenCounter

NOUNS = (
    "system river engine garden market library network signal harbor mountain compiler "
    "kitchen planet bridge archive forest protocol memory village orchestra battery canal "
    "theory cluster lantern museum satellite recipe contract glacier algorithm festival "
    "window teacher island scheduler harvest camera desert cache ledger violin tunnel"
).split()
VERBS = (
    "builds measures carries explains protects follows changes connects balances records "
    "improves describes holds shapes predicts reduces collects supports returns divides "
    "observes repairs stores compares"
).split()
ADJS = (
    "quiet bright ancient rapid careful hidden simple fragile modern distant steady curious "
    "narrow golden practical gentle complex remote sturdy vivid"
).split()
ADVS = ("slowly often rarely quickly carefully always nearly clearly mostly gently").split()
LINKS = ("while because although when since and but so").split()
LANGS = ("French German Spanish Italian Portuguese Dutch Swedish Polish").split()
CODE_TASKS = (
    "parses a CSV file",
    "merges two sorted lists",
    "implements an LRU cache",
    "validates an email address",
    "computes a moving average",
    "walks a directory tree",
    "rate-limits function calls",
    "serializes a binary tree",
)
LANGS_CODE = ("Python", "Rust", "Go", "TypeScript", "C++", "Java")


def sentence(rng: random.Random) -> list[str]:
    words = [rng.choice(ADJS), rng.choice(NOUNS), rng.choice(VERBS), "the", rng.choice(NOUNS)]
    for _ in range(rng.randint(0, 2)):
        words += [
            rng.choice(LINKS),
            "the",
            rng.choice(ADJS),
            rng.choice(NOUNS),
            rng.choice(ADVS),
            rng.choice(VERBS),
            "a",
            rng.choice(NOUNS),
        ]
    words[0] = words[0].capitalize()
    words[-1] += "."
    return words


def words(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        out += sentence(rng)
    return out[:n]


def fit(rng: random.Random, counter: TokenCounter, head: str, tail: str, target: int) -> str:
    """``head + body + tail`` with the longest body whose token count is <= target.

    The random draws do not depend on the counter: the same seed consumes the same numbers with a
    real tokenizer or the approximation, so only the cut point differs.
    """
    pool = words(rng, int(target * 1.5) + 8)

    def build(k: int) -> str:
        return " ".join(p for p in (head, " ".join(pool[:k]), tail) if p)

    lo, hi = 0, len(pool)
    while lo < hi:  # largest k with count(build(k)) <= target
        mid = (lo + hi + 1) // 2
        if counter.count(build(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    return build(lo)


@dataclass(frozen=True)
class TaskKind:
    """A task-like request family: prompt and fixed output length ranges (tokens), a weight."""

    name: str
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    weight: float

    def frame(self, rng: random.Random) -> tuple[str, str]:
        """(head, tail) wrapped around the filler body."""
        n, a = rng.choice(NOUNS), rng.choice(ADJS)
        if self.name == "short_qa":
            return "Answer the question in one or two sentences. Context:", f"Question: what does the {a} {n} do?"
        if self.name == "translation":
            return f"Translate the following text into {rng.choice(LANGS)}:", "Translation:"
        if self.name == "code":
            return (
                f"Write a {rng.choice(LANGS_CODE)} function that {rng.choice(CODE_TASKS)}. Requirements:",
                "Return only the code with brief comments.",
            )
        if self.name == "summary":
            return "Summarize the following report in a short paragraph:", "Summary:"
        if self.name == "story":
            return f"Write a long story about a {a} {n}. Setting:", "Story:"
        if self.name == "analysis":
            return f"Analyze the argument below about the {n} and list its weaknesses:", "Analysis:"
        return f"Write a detailed step-by-step guide to maintaining a {a} {n}. Notes:", "Guide:"


MIXED_TASKS = (
    TaskKind("short_qa", (20, 80), (10, 40), 0.25),
    TaskKind("translation", (40, 200), (40, 200), 0.15),
    TaskKind("code", (60, 250), (150, 500), 0.15),
    TaskKind("summary", (300, 600), (60, 150), 0.15),
    TaskKind("story", (20, 80), (300, 800), 0.10),
    TaskKind("analysis", (150, 500), (150, 400), 0.12),
    TaskKind("long_guide", (30, 120), (500, 800), 0.08),
)
