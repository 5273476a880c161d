"""Orbital's single-process engine: paged KV cache, prefix caching, continuous batching."""
import os as _os

# Idle OpenMP threads sleep instead of spinning: with several replicas (or Ray actors) on few
# cores, spinning threads starve the busy ones (measured 4x slower matmuls here). Only takes
# effect when torch has not been imported yet; set it in the environment to be sure.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.errors import EngineDeadError, InvalidRequestError, OrbitalError, PromptTooLongError
from engine.llm import LLM
from engine.llm_engine import EngineArgs, LLMEngine
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
           "TokenLogprob", "OrbitalError", "InvalidRequestError", "PromptTooLongError", "EngineDeadError"]
