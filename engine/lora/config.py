"""The engine's LoRA settings, checked once (EngineArgs holds the defaults)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from engine.engine_args import EngineArgs
from engine.errors import InvalidRequestError

# The linears an adapter may target (Llama-family names); the fused layer each one lands in and
# its piece there.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORA_RANK_LIMIT = 256


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = EngineArgs.max_loras  # adapters in one batch (slots)
    max_lora_rank: int = EngineArgs.max_lora_rank  # the slots' rank; larger adapters are refused
    max_cpu_loras: int | None = EngineArgs.max_cpu_loras  # adapters held in host memory (LRU); None: max_loras

    def __post_init__(self) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise InvalidRequestError(f"max_loras must be >= 1, got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT:
            raise InvalidRequestError(
                f"max_lora_rank must be in [1, {MAX_LORA_RANK_LIMIT}], got {self.max_lora_rank!r}"
            )
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        if not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise InvalidRequestError(
                f"max_cpu_loras ({self.max_cpu_loras!r}) must be >= max_loras ({self.max_loras}): "
                "every adapter in a slot is also held in host memory"
            )

    @staticmethod
    def from_args(args: EngineArgs) -> LoRAConfig | None:
        if not args.enable_lora:
            if args.lora_modules:
                raise InvalidRequestError("lora_modules needs enable_lora")
            return None
        return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def parse_lora_modules(value: object) -> dict[str, str]:
    """`lora_modules` as vLLM takes it: "name=path" strings (a list, or one string), or a dict
    name -> path; returns name -> path."""
    if not value:
        return {}
    if isinstance(value, dict):
        items = list(value.items())
    else:
        items = []
        for s in [value] if isinstance(value, str) else list(value):
            if not isinstance(s, str) or "=" not in s:
                raise InvalidRequestError(f"lora_modules entries are name=path, got {s!r}")
            name, path = s.split("=", 1)
            items.append((name.strip(), path.strip()))
    out: dict[str, str] = {}
    for name, path in items:
        if not name or not path:
            raise InvalidRequestError(f"lora_modules entries are name=path, got {name!r}={path!r}")
        if name in out:
            raise InvalidRequestError(f"lora_modules names {name!r} twice")
        out[name] = str(path)
    return out


def add_lora_flags(parser: argparse.ArgumentParser, default: Callable[[str], object]) -> None:
    """The LoRA flags with vLLM's names, for both CLIs; `default(field)`: the caller's one source
    of defaults (EngineArgs or AppConfig, which takes EngineArgs')."""
    parser.add_argument("--enable-lora", action="store_true", help="serve PEFT LoRA adapters of the model")
    parser.add_argument("--max-loras", type=int, default=default("max_loras"), help="LoRA adapters in one batch")
    parser.add_argument(
        "--max-lora-rank", type=int, default=default("max_lora_rank"), help="the largest LoRA rank the slots hold"
    )
    parser.add_argument(
        "--max-cpu-loras",
        type=int,
        default=default("max_cpu_loras"),
        help="LoRA adapters kept in host memory, LRU (default: --max-loras)",
    )
    parser.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME=PATH", help="LoRA adapters served from the start"
    )
