"""A request's place in its grammar (llguidance's matcher), and the tokenizer view it needs.

The scheduler owns one `GrammarMatcher` per constrained request (engine/request.py): it
computes the allowed-token bitmask of each position a step samples (the next token, and each
draft position of a speculative step) and consumes the tokens the step emits. So the state
lives with the request, not with a model runner: preemption, tensor parallelism and a
resumed request need nothing more.

A matcher with `after` (StructuredOutput.after_token_ids) waits: until the output contains that
sequence it neither masks nor consumes, and the grammar starts at the token after it. A step's
drafts that complete the sequence are free up to it, and those after it are held to the
grammar from its start (`valid_prefix`, `step_masks`), so a speculative step crosses the
boundary exactly as single steps would.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Sequence

import torch

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from llguidance import LLTokenizer
    from transformers import PreTrainedTokenizerBase


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


class GrammarTokenizer:
    """llguidance's view of the model's tokenizer, built on first use (~0.5 s for SmolLM2's
    49152 tokens) and shared by every matcher of the engine. `vocab_size` is the model's
    (the logits' width): ids past the tokenizer's own are never allowed."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf, self.vocab_size, self._eos = hf_tokenizer, vocab_size, list(eos_token_ids)
        self._ll = None
        self._lock = threading.Lock()

    def get(self) -> LLTokenizer:
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                try:
                    self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self._eos)
                except ValueError as e:  # a slow (Python) tokenizer, a vocabulary that does not fit
                    raise InvalidRequestError(f"structured outputs are not available for this tokenizer: {e}") from None
            return self._ll

    def matcher(self, grammar: str, param: str, after: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher at the grammar's start (waiting for `after`, if any). A grammar that runs
        out of llguidance's limits (`_limits`: lexer fuel and expressions, counted in work, not
        time, so the same on every machine) in its first mask or on the first token that mask
        allows is refused here: the step thread computes every mask of every step (a regex
        `x{300000}` takes ~60 ms for its first mask, then fails on its first token). One that
        runs out later fails its own request (`error`)."""
        m = GrammarMatcher(self.get(), grammar, self.vocab_size, param, after)
        error = m.error or m.first_token_error()
        if error is not None:
            raise InvalidRequestError(f"{param}: too costly to follow: {error}", param=param)
        return m


class GrammarMatcher:
    def __init__(
        self, ll_tokenizer: LLTokenizer, grammar: str, vocab_size: int, param: str, after: Sequence[int] = ()
    ) -> None:
        from llguidance import LLMatcher

        self._m = LLMatcher(ll_tokenizer, grammar, log_level=0, limits=_limits())
        self.width = bitmask_width(vocab_size)
        if self._m.is_error():  # the grammar was valid alone, but not with this tokenizer
            raise InvalidRequestError(f"{param}: {self._m.get_error()[:500]}", param=param)
        self.after = tuple(after)
        self.waiting = bool(self.after)  # the output has not yet contained `after`
        self._recent: list[int] = []  # while waiting: the output's last len(after) tokens

    def _free(self, drafts: list[int]) -> int | None:
        """How many of these next tokens come before the grammar starts: 0 once it has; the
        count up to and including the one that completes `after`; None if none does."""
        if not self.waiting:
            return 0
        n, recent = len(self.after), list(self._recent)
        for i, t in enumerate(drafts):
            recent = (recent + [t])[-n:]
            if tuple(recent) == self.after:
                return i + 1
        return None

    @property
    def error(self) -> str | None:
        if not self._m.is_error():
            return None
        return f"the output's grammar failed: {self._m.get_error().strip().splitlines()[0][:300]}"

    def is_stopped(self) -> bool:
        """Nothing may follow (the grammar ended, or its end token was consumed)."""
        return not self.waiting and self._m.is_stopped()

    def first_token_error(self) -> str | None:
        """Why the grammar fails on the first token its first mask allows (on a copy); None if
        it takes it, or allows none."""
        mask = self.bitmasks([])[0]
        words = torch.nonzero(mask)
        if not len(words):
            return None
        w = int(words[0])
        bits = int(mask[w]) & 0xFFFFFFFF
        token = 32 * w + (bits & -bits).bit_length() - 1
        probe = self._m.deep_copy()
        if probe.consume_token(token) or not probe.is_error():
            return None
        return f"the output's grammar failed: {probe.get_error().strip().splitlines()[0][:300]}"

    def accept(self, token_id: int) -> bool:
        """Consume one emitted token; False (and an error state) if the grammar refuses it.
        While waiting: note it, and start the grammar after it if it completes `after`."""
        if self.waiting:
            self._recent = (self._recent + [token_id])[-len(self.after) :]
            self.waiting = tuple(self._recent) != self.after
            return True
        return self._m.consume_token(token_id)

    def accept_all(self, token_ids: list[int]) -> bool:
        return all(self.accept(t) for t in token_ids)

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of these draft tokens the grammar allows in a row from here (all of them
        before it starts)."""
        k = self._free(drafts)
        if k is None:
            return len(drafts)
        rest = drafts[k:]
        return k + (self._m.validate_tokens(rest) if rest else 0)

    @staticmethod
    def batch_bitmasks(matchers: list[GrammarMatcher]) -> torch.Tensor:
        """[len(matchers), width]: each matcher's next-token mask, several in one parallel call."""
        if len(matchers) == 1:
            return matchers[0].bitmasks([])
        width = matchers[0].width
        out = torch.empty(len(matchers), width, dtype=torch.int32)
        _executor().unsafe_compute_mask_ptr(
            [(m._m, i) for i, m in enumerate(matchers)], out.data_ptr(), width * 4, len(out)
        )
        return out

    def step_masks(self, drafts: list[int]) -> torch.Tensor | None:
        """`bitmasks` of a step that scores the next position and one after each draft (drafts
        from `valid_prefix`): rows before the grammar starts allow every token; None when no
        position of the step is held."""
        k = self._free(drafts)
        if k is None:
            return None
        held = self.bitmasks(drafts[k:])
        if not k:
            return held
        return torch.cat([torch.full((k, self.width), -1, dtype=torch.int32), held])

    def bitmasks(self, drafts: list[int]) -> torch.Tensor:
        """[1 + len(drafts), width] int32: the tokens allowed at the next position and after
        each draft (drafts must be a valid prefix). The drafts go through a copy: rolling back
        is not exact once the grammar has ended (an end token consumed then is not counted)."""
        out = torch.empty(1 + len(drafts), self.width, dtype=torch.int32)
        nbytes = self.width * 4
        m = self._m.deep_copy() if drafts else self._m
        for j in range(1 + len(drafts)):
            m.unsafe_compute_mask_ptr(out[j].data_ptr(), nbytes)
            if j < len(drafts) and not m.consume_token(drafts[j]):
                raise RuntimeError(f"draft token {drafts[j]} is outside the grammar")
        return out


def step_bitmasks(scheduled: list, spec_tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The bitmasks of a step's constrained requests that sample in it (their scheduled tokens
    reach the end of what they have), one row per scored position; none for a request whose
    grammar has not started and does not start within the step. Started requests without
    drafts get theirs in one parallel call (llguidance's executor threads, the GIL dropped)."""
    out, plain = {}, []
    for r in scheduled:
        if r.grammar is None or r.num_computed_tokens < r.num_tokens:
            continue
        drafts = spec_tokens.get(r.request_id)
        if drafts or r.grammar.waiting:
            masks = r.grammar.step_masks(drafts or [])
            if masks is not None:
                out[r.request_id] = masks
        else:
            plain.append(r)
    if plain:
        masks = GrammarMatcher.batch_bitmasks([r.grammar for r in plain])
        out.update((r.request_id, masks[i : i + 1]) for i, r in enumerate(plain))
    return out


@functools.cache
def _limits():
    """A quarter of llguidance's default lexer fuel per step: a mask that needs more fails its
    request (finish_reason "error") instead of stalling every step; `(Q|R)x{100000}` took ~48 ms
    per token at the default, ~11 ms before failing with this. JSON schemas, enums of 3000
    strings and `[a-z]{5000}` take well under 1 ms either way."""
    from llguidance import LLParserLimits

    return LLParserLimits(step_lexer_fuel=50_000, initial_lexer_fuel=250_000, verbose_errors=False)


@functools.cache
def _executor():
    from llguidance import LLExecutor

    return LLExecutor(num_threads=max(1, torch.get_num_threads()))
