"""Find a model (embedded default, GGUF file, HF directory) and load it into our Llama code.

No code here downloads anything: a model is either the embedded wheel or a local path.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from engine.layers.packed_gemm import packing_enabled
from engine.model.gguf_convert import EMBEDDED_NAME, convert_gguf, embedded_gguf_path

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from engine.model.llama import LlamaForCausalLM


def resolve_model_dir(model: str | None) -> Path:
    """Return a local HF directory for `model` (None = the embedded SmolLM2-135M-Instruct)."""
    if model is None or model in ("", "default", EMBEDDED_NAME, f"HuggingFaceTB/{EMBEDDED_NAME}"):
        return convert_gguf(embedded_gguf_path(), EMBEDDED_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    raise FileNotFoundError(
        f"model {model!r} is not a local directory or .gguf file; Orbital never downloads weights, "
        "pass a local path (or nothing for the embedded SmolLM2-135M-Instruct)"
    )


def safetensors_files(model_dir: Path) -> list[str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [str(model_dir / s) for s in shards]
    files = sorted(glob.glob(str(model_dir / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, object]]:
    """Yield (name, lazy slice): each TP rank reads only the rows/columns it keeps."""
    from safetensors import safe_open

    for f in safetensors_files(model_dir):
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_slice(name)


def load_model(
    model_dir: Path,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """`quantization` ("int8"): each rank quantizes its own shards after loading (scales per
    output channel stay with their rows), instead of packing them."""
    from engine.model.llama import LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM(hf_config, max_position=max_position, dtype=dtype)
    model.load_weights(iterate_weights(model_dir))
    if quantization is not None:
        for module in model.modules():
            if hasattr(module, "quantize_weights"):
                module.quantize_weights(quantization)
        if torch.device(device).type == "cpu":
            from engine.cpu_malloc import release_free_memory

            release_free_memory()
    elif packing_enabled(dtype, torch.device(device)):
        for module in model.modules():
            if hasattr(module, "pack_weights"):
                module.pack_weights()
    return model.eval()


def parameter_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
