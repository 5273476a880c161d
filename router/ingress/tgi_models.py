"""Hugging Face TGI API bodies (pydantic): POST /, /generate, /generate_stream; GET /info.

Field names and defaults follow text-generation-inference, which is what
`huggingface_hub.InferenceClient(base_url).text_generation(...)` sends and parses.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN/inf: 400, not a sampler fault

    max_new_tokens: int | None = Field(100, description="Tokens to generate (TGI's default: 100).")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    do_sample: bool = False
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool | None = False
    top_n_tokens: int | None = None
    best_of: int | None = None
    truncate: int | None = None
    watermark: bool = False
    grammar: Any | None = None
    adapter_id: str | None = None


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN/inf: 400, not a sampler fault

    inputs: str = Field(..., min_length=1)
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class Details(BaseModel):
    finish_reason: str  # "length" | "eos_token" | "stop_sequence"
    generated_tokens: int
    seed: int | None = None
    prefill: list[Token] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)
    top_tokens: list[list[Token]] | None = None


class StreamDetails(BaseModel):
    finish_reason: str
    generated_tokens: int
    input_length: int
    seed: int | None = None


class StreamResponse(BaseModel):
    index: int
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None
