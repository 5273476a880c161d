"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some
strings, or a grammar (Lark or GBNF). Compiled at construction into an llguidance grammar and
checked there, so a bad schema is refused where the request arrives (HTTP 400), before any
engine work; only the grammar text travels on (it pickles as a string).

`after_token_ids` holds the grammar back until the output contains that token sequence (a
reasoning model's `</think>`, as the tokenizer encodes it): the tokens up to and including it
are free, the grammar applies from the next one on, and an output that never contains it is
not held at all. Empty: the grammar applies from the first token.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from engine.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")

# One-line JSON with Python's separators. llguidance's default lets whitespace run anywhere,
# and a small model then fills a constrained object with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
MAX_SPEC_CHARS = 64 * 1024
MAX_AFTER_TOKENS = 32


@dataclass
class StructuredOutput:
    kind: str  # one of KINDS
    value: Any = None  # json: a schema (dict or its text); regex/grammar: text; choice: list[str]
    param: str = "structured_outputs"  # the request field errors name
    after_token_ids: tuple[int, ...] = ()  # the grammar starts after these tokens of the output
    grammar: str = field(default="", init=False)  # llguidance's grammar text, set at construction

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise self._bad(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        self.after_token_ids = _token_ids(self.after_token_ids, self._bad)
        self.grammar = self._compile()
        from llguidance import LLMatcher

        problem = _guarded(lambda: LLMatcher.validate_grammar(self.grammar), self._bad)
        if problem and not problem.startswith("WARNING"):
            raise self._bad(f"is not a valid {self.kind}: {problem.strip()[:500]}")

    def starting_after(self, token_ids: Sequence[int]) -> StructuredOutput:
        """A copy held back until the output contains `token_ids` (the grammar is not compiled
        again)."""
        out = copy.copy(self)
        out.after_token_ids = _token_ids(token_ids, self._bad)
        return out

    def _bad(self, msg: str) -> InvalidRequestError:
        return InvalidRequestError(f"{self.param}: {msg}", param=self.param)

    def _compile(self) -> str:
        import llguidance
        from llguidance import LLMatcher

        v = self.value
        if self.kind == "json_object":
            v = {"type": "object"}
        if self.kind in ("json", "json_object"):
            if isinstance(v, str):
                v = _guarded(lambda: json.loads(v), lambda m: self._bad(f"the schema is not JSON ({m})"))
            if not isinstance(v, dict):
                raise self._bad("a JSON schema must be an object")
            self._check_size(json.dumps(v))
            return _guarded(lambda: LLMatcher.grammar_from_json_schema(v, defaults=JSON_OPTIONS), self._bad)
        if self.kind == "choice":
            if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
                raise self._bad("choice must be a non-empty list of non-empty strings")
            self._check_size(json.dumps(v))
            return _guarded(lambda: llguidance.grammar_from("choice", json.dumps(v)), self._bad)
        if not isinstance(v, str) or not v:
            raise self._bad(f"{self.kind} must be a non-empty string")
        self._check_size(v)
        fmt = "regex" if self.kind == "regex" else "grammar"  # "grammar": Lark or GBNF
        return _guarded(lambda: llguidance.grammar_from(fmt, v), self._bad)

    def _check_size(self, text: str) -> None:
        if len(text) > MAX_SPEC_CHARS:
            raise self._bad(f"is longer than {MAX_SPEC_CHARS} characters")


def _token_ids(ids, bad) -> tuple[int, ...]:
    ids = tuple(ids or ())
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
        raise bad("after_token_ids must be non-negative integers")
    if len(ids) > MAX_AFTER_TOKENS:
        raise bad(f"after_token_ids accepts at most {MAX_AFTER_TOKENS} ids")
    return ids


def _guarded(fn, bad):
    """llguidance raises ValueError for bad input, and a Rust panic surfaces as a
    BaseException (pyo3's PanicException): either is the client's input, a 400."""
    try:
        return fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - see the docstring
        raise bad(str(e).strip()[:500] or type(e).__name__) from None
