"""Random-weight Llama checkpoints for the GPU and tensor-parallel benchmarks and the GPU tests, built with transformers and saved as
real HF directories (the embedded GGUF is too big to carry to a GPU machine). The tokenizer
comes from ORBITAL_TOKENIZER_DIR (a folder with SmolLM2's tokenizer files) or the embedded model."""

from __future__ import annotations

import os

import torch

# SmolLM2-135M's shape (the embedded model) and a ~1B Llama (Llama-3.2-1B's layers, SmolLM2's vocab).
SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    # SmolLM2-135M's sizes with heads that split over 1, 2 and 3 ranks (bench/bench_tp.py).
    "smollm2-135m-12h": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=12,
        num_key_value_heads=6,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    # Llama-3-8B's layers (SmolLM2's vocabulary, so ~7.4B parameters): the GPU profile's large shape.
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
    # ~0.43B parameters: three times SmolLM2-135M's, still quick to step on 2 CPU cores (bench/bench_pp.py).
    "llama-350m": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
}


def tokenizer_dir() -> str:
    d = os.environ.get("ORBITAL_TOKENIZER_DIR")
    if d:
        return d
    from engine.model.loader import resolve_model_dir

    return str(resolve_model_dir(None))


def save_random_llama(
    path, shape: str, dtype=torch.float32, init_range: float = 0.02, seed: int = 0, device: str = "cuda"
):
    """Build, save and return (eval model on `device`, tokenizer)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir())
    cfg = LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=init_range,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model, tok


def model_dir(root: str | None, shape: str, dtype=torch.bfloat16, device: str = "cuda") -> str:
    """A saved random model of `shape`: built once under `root` and reused (a temporary folder
    kept for the process when `root` is None)."""
    import pathlib
    import tempfile

    base = pathlib.Path(root) if root else pathlib.Path(tempfile.mkdtemp(prefix="orbital-random-"))
    path = base / f"{shape}-{str(dtype)[6:]}"
    if not (path / "config.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        model, _ = save_random_llama(path, shape, dtype, device=device)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return str(path)
