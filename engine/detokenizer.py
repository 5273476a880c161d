"""Incremental detokenization: token ids in, text deltas out, O(window) work per token.

Prefix-offset / read-offset technique (TGI, vLLM): decode a short window of already-emitted
tokens (`prefix`) alone and together with the new ones, and emit the difference. The window gives
byte-level BPE and SentencePiece tokenizers the context they need for leading spaces. When the
new text ends in U+FFFD, a multi-byte character is split across tokens: emit nothing and wait,
so a replacement character that would later change is never streamed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens used as the first window (leading-space context)


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only the window is kept from the prompt; output ids are appended as they come.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # cached decode of ids[prefix:read]

    def _decode(self, ids: list[int]) -> str:
        # clean_up_tokenization_spaces=False: the clean-up is not local to a window.
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

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
