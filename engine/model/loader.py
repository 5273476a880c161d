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


def gguf_file_of(model: str | None) -> Path | None:
    """The GGUF file `model` names (None = the embedded one), or None for an HF directory."""
    if model is None or model in ("", "default", EMBEDDED_NAME, f"HuggingFaceTB/{EMBEDDED_NAME}"):
        return embedded_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model_dir(model: str | None, float_weights: bool = True) -> Path:
    """Return a local HF directory for `model` (None = the embedded SmolLM2-135M-Instruct).
    float_weights=False: a GGUF's directory may hold only its config and tokenizer."""
    gguf = gguf_file_of(model)
    if gguf is not None:
        is_embedded = model is None or Path(model).suffix != ".gguf"
        return convert_gguf(gguf, EMBEDDED_NAME if is_embedded else None, float_weights)
    path = Path(model).expanduser()
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
    gguf_file: Path | None = None,
) -> LlamaForCausalLM:
    """`quantization` (quant/spec.py): each rank quantizes its own shards after loading (scales
    stay with their rows) instead of packing them; "gguf" reads `gguf_file`'s blocks as they are,
    "gptq" / "awq" the checkpoint's own integers and scales (gptq_awq.py).
    The quantized shard is saved once (quant_checkpoint.py) and read back on the next start."""
    from engine.distributed import get_pp_group, get_tp_group
    from engine.layers.quant import parse_quantization
    from engine.model import quant_checkpoint
    from engine.model.llama import LlamaForCausalLM

    spec = parse_quantization(quantization)
    with torch.device(device):
        model = LlamaForCausalLM(hf_config, max_position=max_position, dtype=dtype)
    if spec is None:
        model.load_weights(iterate_weights(model_dir))
        if packing_enabled(dtype, torch.device(device)):
            for module in model.modules():
                if hasattr(module, "pack_weights"):
                    module.pack_weights()
        return model.eval()
    sources = [gguf_file] if spec.method == "gguf" else [Path(f) for f in safetensors_files(model_dir)]
    tp, pp = get_tp_group(), get_pp_group()
    saved = quant_checkpoint.cache_path(
        sources, str(spec), dtype, tp.rank, tp.size, torch.device(device).type, pp.layers if pp.size > 1 else None
    )
    if saved.is_file():
        quant_checkpoint.load(model, saved)
    else:
        if spec.method == "gguf":
            from engine.model.gguf_weights import iterate_gguf_weights

            model.load_weights(iterate_gguf_weights(gguf_file, hf_config))
        elif spec.method in ("gptq", "awq"):
            from engine.model.gptq_awq import checkpoint_quantization, iterate_quantized_weights

            model.load_weights(iterate_quantized_weights(sources, checkpoint_quantization(hf_config)))
        else:
            model.load_weights(iterate_weights(model_dir))
        for module in model.modules():
            if hasattr(module, "quantize_weights"):
                module.quantize_weights(spec)
        quant_checkpoint.save(model, saved)
    if torch.device(device).type == "cpu":
        from engine.runner.cpu_malloc import release_free_memory

        release_free_memory()
    return model.eval()


def parameter_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
