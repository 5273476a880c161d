"""A tiny random Llama and random PEFT LoRA adapters on it, written with peft, for the LoRA tests
(the engine's and the workers')."""

from __future__ import annotations

from pathlib import Path

import torch

# Three adapters that differ in rank, scaling and targets (fused pieces alone or together,
# row-parallel ones, one layer only).
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp1": dict(r=2, lora_alpha=4, target_modules=["o_proj", "up_proj", "down_proj"], layers_to_transform=[1]),
    # A fourth: a batch of all four computes its deltas with grouped matmuls (engine/lora/batch.py).
    "kgate": dict(r=6, lora_alpha=6, target_modules=["k_proj", "gate_proj"]),
}


def save_tiny_llama(path: Path, tokenizer, **overrides) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = (
        dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.3,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=False,
        )
        | overrides
    )
    LlamaForCausalLM(LlamaConfig(**cfg)).float().eval().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def load_base(path: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def save_adapter(base_dir: Path, out: Path, seed: int, **lora_kwargs):
    """A peft adapter with every A and B drawn at random (peft starts B at zero, which would make
    the adapter the base model); returns the peft model, the reference for it."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_base(base_dir), LoraConfig(lora_dropout=0.0, **lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)
    model.save_pretrained(out, safe_serialization=True)
    return model.eval()
