"""Incremental detokenization: token ids in, text deltas out, O(window) work per token.

Prefix-offset / read-offset technique (TGI, vLLM): decode a short window of already-emitted
tokens (`prefix`) alone and together with the new ones, and emit the difference. The window gives
byte-level BPE and SentencePiece tokenizers the context they need for leading spaces. When the
new text ends in U+FFFD, a multi-byte character is split across tokens: emit nothing and wait,
so a replacement character that would later change is never streamed.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens used as the first window (leading-space context)


def raw_decoder(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text as `tokenizer.decode(ids, skip_special_tokens, clean_up_tokenization_spaces=False)`
    (the clean-up is not local to a window). For a Rust-backed tokenizer whose class keeps the
    base `_decode`, that is exactly the backend's own decode: calling it directly skips
    transformers' argument handling, ~85% of the cost of a one-token decode (two per token and
    stream, so at 256 streams it was the largest host cost of a decode step)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    base = _base_fast_decode()
    cls = type(tokenizer)
    if backend is not None and base is not None and (cls._decode, cls.decode) == base:
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(
        tokenizer.decode, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


@functools.cache
def _base_fast_decode():
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the generic path
        return None
    return TokenizersBackend._decode, TokenizersBackend.decode


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = raw_decoder(tokenizer, skip_special_tokens)
        # Only the window is kept from the prompt; output ids are appended as they come.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # cached decode of ids[prefix:read]

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids)

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text that is now final (possibly "")."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the sequence: emit whatever was held back (with U+FFFD if the model
        really stopped mid-character), so the joined deltas equal a full decode."""
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""  # only skipped special tokens, or an incomplete UTF-8 sequence: wait
        delta = new_text[len(self._prefix_text) :]
        # The window slides: what was new becomes the next prefix. Older ids are never decoded
        # again, so each step costs O(window), not O(output length).
        self._prefix_text = None
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return delta
