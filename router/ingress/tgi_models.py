"""Hugging Face TGI API bodies (pydantic): POST /, /generate, /generate_stream; GET /info.

Field names and defaults follow text-generation-inference, which is what
`huggingface_hub.InferenceClient(base_url).text_generation(...)` sends and parses.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Grammar(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["json", "regex"]
    value: dict[str, Any] | str = Field(..., description="json: a JSON schema; regex: a regular expression.")


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN/inf: 400, not a sampler fault

    max_new_tokens: int | None = Field(100, ge=1, description="Tokens to generate (TGI's default: 100).")
    # Bounds as the handler and SamplingParams check them, so the schema says what is valid.
    temperature: float | None = Field(None, gt=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    typical_p: float | None = Field(None, gt=0, le=1, description="Locally typical sampling: the mass kept.")
    repetition_penalty: float | None = Field(None, gt=0)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    do_sample: bool = False
    stop: list[str] = Field(default_factory=list, max_length=16)
    seed: int | None = None
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool | None = False
    top_n_tokens: int | None = Field(None, ge=0, le=20)
    best_of: Literal[1] | None = Field(None, description="Only 1 (no best-of sampling).")
    truncate: int | None = Field(None, ge=1, description="Keep only the last `truncate` prompt tokens.")
    watermark: bool = Field(False, description="Green-list watermark (the deployment's key; 400 when it has none).")
    grammar: Grammar | None = Field(None, description="The output must match a JSON schema or a regex.")
    adapter_id: str | None = Field(
        None, description="A LoRA adapter served with enable_lora (404 for an unknown one); None: the base model."
    )
    priority: int = Field(0, description="Extension: lower runs first under scheduling_policy 'priority'.")


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
