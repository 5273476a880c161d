"""An OpenAI request's sampling fields -> the engine's SamplingParams: the usual ones,
logit_bias (token ids as strings) and structured outputs (response_format, the
structured_outputs extension and its older guided_* spelling)."""

from __future__ import annotations

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from router.ingress.openai_models import ChatCompletionRequest, CompletionRequest, StructuredOutputs

Request = CompletionRequest | ChatCompletionRequest


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for k, v in bias.items():
        try:
            out[int(k)] = v
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from None
    return out


def _structured(req: Request) -> StructuredOutput | None:
    """OpenAI's response_format (json_object, json_schema), or the structured_outputs extension
    (or its older guided_* spelling)."""
    rf, so = req.response_format, req.structured_outputs
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice}
    guided = {k: v for k, v in {**guided, "grammar": req.guided_grammar}.items() if v is not None}
    if guided:
        if so is not None:
            raise InvalidRequestError("set structured_outputs or the guided_* fields, not both", "structured_outputs")
        so = StructuredOutputs.model_validate(guided)
    if rf is not None and rf.type != "text":
        if so is not None:
            raise InvalidRequestError("set response_format or structured_outputs, not both", param="response_format")
        if rf.type == "json_schema":
            if rf.json_schema is None:
                raise InvalidRequestError("response_format json_schema needs 'json_schema'", param="response_format")
            return StructuredOutput("json", rf.json_schema.schema_ or {}, param="response_format")
        return StructuredOutput("json_object", param="response_format")
    if so is None:
        return None
    given = {k: v for k, v in so.model_dump(by_alias=True).items() if v is not None and v is not False}
    if len(given) != 1:
        raise InvalidRequestError(
            "structured_outputs takes exactly one of json, json_object, regex, choice, grammar",
            param="structured_outputs",
        )
    ((kind, value),) = given.items()
    return StructuredOutput(kind, value)


def sampling_params(
    req: Request, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        typical_p=1.0 if req.typical_p is None else req.typical_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias=_logit_bias(req.logit_bias),
        structured_output=_structured(req),
        cache_salt=req.cache_salt,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
    )
