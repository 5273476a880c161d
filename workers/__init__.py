"""Ray side of execution: tensor-parallel ranks as actors, their process group, placement,
and the executor factory that builds tp>1 engines (`make_executor`, `LLM`)."""

from __future__ import annotations

import importlib

_EXPORTS = {"LLM": "workers.offline_llm", "make_executor": "workers.executor_factory"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
