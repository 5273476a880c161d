"""Orbital's single-process engine: paged KV cache, prefix caching, continuous batching.

Exports are lazy: `import engine.engine_args` (the serving layer's config does) stays free of
torch and transformers.
"""

import importlib as _importlib
import os as _os

# Idle OpenMP threads sleep instead of spinning: with several replicas (or Ray actors) on few
# cores, spinning threads starve the busy ones (measured 4x slower matmuls here). Only takes
# effect when torch has not been imported yet; set it in the environment to be sure.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineArgs": "engine.engine_args",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "TokenLogprob": "engine.outputs",
    "OrbitalError": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "PromptTooLongError": "engine.errors",
    "EngineDeadError": "engine.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(_importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
