"""The part of a model directory a router needs: tokenizer, config, generation config and chat
template, never the weights. A router may run where the model path does not exist (the head node
of a cluster whose weights sit on the GPU nodes only): it gets these files from an engine
replica and writes them into a local directory keyed by their content."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt", ".onnx")
MAX_FILE_BYTES = 64 << 20  # tokenizer.json of large vocabularies is ~20 MB; weights never pass


def text_side_files(model_dir: Path) -> dict[str, bytes]:
    """The directory's top-level files that are not weights (name -> bytes)."""
    files = {}
    for p in sorted(Path(model_dir).iterdir()):
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and p.stat().st_size <= MAX_FILE_BYTES:
            files[p.name] = p.read_bytes()
    if "config.json" not in files:
        raise FileNotFoundError(f"{model_dir} has no config.json")
    return files


def materialise_text_side(files: dict[str, bytes], root: Path) -> Path:
    """A local directory holding `files` (reused when the same files were written before)."""
    digest = hashlib.sha256()
    for name in sorted(files):
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"not a plain file name: {name!r}")
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    target = root / "text_side" / digest.hexdigest()[:16]
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent))
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    try:
        os.rename(tmp, target)  # atomic: another router on this node may write the same files
    except OSError:
        if not target.is_dir():
            raise
    return target
