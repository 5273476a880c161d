"""Orbital's single-process engine: paged KV cache, prefix caching, continuous batching."""
from engine.errors import EngineDeadError, InvalidRequestError, OrbitalError, PromptTooLongError
from engine.llm import LLM
from engine.llm_engine import EngineArgs, LLMEngine
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
           "TokenLogprob", "OrbitalError", "InvalidRequestError", "PromptTooLongError", "EngineDeadError"]
