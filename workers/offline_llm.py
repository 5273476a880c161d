"""The offline API at any tensor-parallel size: `engine.LLM` built with the Ray executor factory."""

from __future__ import annotations

from typing import Any

from engine.llm import LLM as _EngineLLM
from workers.executor_factory import make_executor


class LLM(_EngineLLM):
    """`LLM(model, tensor_parallel_size=2)`: ranks 1..tp-1 run as Ray actors (a local Ray is
    started if none runs, and shut down with the LLM)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        super().__init__(model, executor_factory=make_executor, **kwargs)
