"""No request field is accepted and ignored: every property of every request body that
`/openapi.json` advertises (and of TGI's `parameters` and OpenAI's `stream_options`) is either

- a sampling field: setting it to a probe value changes the `SamplingParams` the ingress builds
  (checked here, through the ingress's own conversion functions), or
- shown by a named test to change the response or the engine's input, or to be refused with a
  400/422 (checked here: the test exists).

A field added to a request model without one of these fails this test. No Ray: the schema comes
from the ingress's FastAPI app."""

from __future__ import annotations

import ast
import pathlib

import pytest

from router.ingress import openai_sampling, tgi_api
from router.ingress.deployment import app
from router.ingress.openai_models import ChatCompletionRequest, CompletionRequest
from router.ingress.tgi_models import GenerateParameters

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Probe values of the fields that become SamplingParams (OpenAI and TGI spellings).
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
OPENAI_SAMPLING = {
    "n": 2,
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 5,
    "min_p": 0.1,
    "typical_p": 0.5,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.2,
    "seed": 7,
    "max_tokens": 3,
    "min_tokens": 2,
    "stop": ["x"],
    "stop_token_ids": [5],
    "ignore_eos": True,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "logit_bias": {"5": 1.0},
    "cache_salt": "salt",
    "truncate_prompt_tokens": 4,
    "response_format": {"type": "json_object"},
    "structured_outputs": {"regex": "a+"},
    "guided_json": SCHEMA,
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": 'start: "a"',
}
TGI_SAMPLING = {
    "do_sample": True,
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 5,
    "typical_p": 0.5,
    "repetition_penalty": 1.2,
    "frequency_penalty": 0.5,
    "seed": 7,
    "max_new_tokens": 3,
    "stop": ["x"],
    "top_n_tokens": 2,
    "decoder_input_details": True,
    "grammar": {"type": "regex", "value": "a+"},
    "truncate": 4,
}

RF = "tests/router/test_request_fields.py"
OA = "tests/router/test_openai_api.py"
TK = "tests/router/test_tokenize.py"
RS = "tests/router/test_responses_api.py"
EM = "tests/router/test_embeddings_http.py"
# Fields whose effect is outside SamplingParams, or that are refused: the test that shows it.
SHOWN_BY = {
    "CompletionRequest": {
        "model": "tests/router/test_multi_model.py::test_each_model_answers_under_its_name",
        "prompt": f"{OA}::test_prompt_list_and_token_ids",
        "echo": f"{OA}::test_echo_with_logprobs",
        "logprobs": f"{OA}::test_logprobs",
        "stream": f"{OA}::test_completion_stream_equals_non_stream",
        "stream_options": f"{OA}::test_completion_stream_equals_non_stream",
        "stream_options.include_usage": f"{OA}::test_completion_stream_equals_non_stream",
        "stream_options.continuous_usage_stats": f"{RF}::test_continuous_usage_stats",
        "priority": f"{RF}::test_a_high_priority_request_goes_ahead_of_the_queue",
        "watermark": f"{RF}::test_watermarked_outputs_over_http_are_detected",
        "suffix": f"{RF}::test_suffix_and_best_of_are_refused",
        "best_of": f"{RF}::test_suffix_and_best_of_are_refused",
        "user": f"{RF}::test_user_is_logged_with_the_request_id",
    },
    "ChatCompletionRequest": {
        "model": "tests/router/test_multi_model.py::test_each_model_answers_under_its_name",
        "messages": f"{OA}::test_chat_greedy_equals_offline",
        "max_completion_tokens": f"{OA}::test_chat_greedy_equals_offline",
        "logprobs": f"{OA}::test_logprobs",
        "top_logprobs": f"{OA}::test_logprobs",
        "stream": f"{OA}::test_chat_stream",
        "stream_options": f"{RF}::test_continuous_usage_stats",
        "stream_options.include_usage": f"{OA}::test_completion_stream_equals_non_stream",
        "stream_options.continuous_usage_stats": f"{RF}::test_continuous_usage_stats",
        "priority": f"{RF}::test_a_high_priority_request_goes_ahead_of_the_queue",
        "watermark": f"{RF}::test_watermarked_outputs_over_http_are_detected",
        "tools": "tests/router/test_tools_http.py::test_named_function",
        "tool_choice": "tests/router/test_tools_http.py::test_named_function",
        "parallel_tool_calls": "tests/router/test_tools_http.py::test_required_single_and_parallel",
        "chat_template_kwargs": "tests/router/test_errors.py::test_chat_template_kwargs_cannot_replace_the_template",
        "add_generation_prompt": f"{RF}::test_chat_generation_prompt_fields",
        "continue_final_message": f"{RF}::test_chat_generation_prompt_fields",
        "user": f"{RF}::test_user_is_logged_with_the_request_id",
    },
    "ResponsesRequest": {
        "model": f"{RS}::test_unsupported_fields_are_400s_naming_them",
        "input": f"{RS}::test_create_equals_chat_completions",
        "instructions": f"{RS}::test_create_equals_chat_completions",
        "metadata": f"{RS}::test_create_equals_chat_completions",
        "user": f"{RS}::test_create_equals_chat_completions",
        "temperature": f"{RS}::test_create_equals_chat_completions",
        "top_p": f"{RS}::test_top_p_reaches_the_sampler",
        "max_output_tokens": f"{RS}::test_max_output_tokens_is_honoured",
        "stream": f"{RS}::test_stream_events",
        "previous_response_id": f"{RS}::test_previous_response_id_continues_the_conversation",
        "store": f"{RS}::test_store_false_is_not_kept",
        "text": f"{RS}::test_text_format_json_schema",
        "tools": f"{RS}::test_function_tool_round_trip",
        "tool_choice": f"{RS}::test_function_tool_round_trip",
        "parallel_tool_calls": f"{RS}::test_required_calls_and_parallel_tool_calls",
        **{
            f: f"{RS}::test_unsupported_fields_are_400s_naming_them"
            for f in (
                "truncation",
                "background",
                "conversation",
                "include",
                "max_tool_calls",
                "prompt",
                "prompt_cache_key",
                "prompt_cache_retention",
                "reasoning",
                "safety_identifier",
                "service_tier",
                "stream_options",
                "top_logprobs",
            )
        },
    },
    "WatermarkDetectRequest": {
        "text": f"{RF}::test_watermarked_outputs_over_http_are_detected",
        "token_ids": f"{RF}::test_watermarked_outputs_over_http_are_detected",
    },
    "TokenizeRequest": {
        "model": f"{TK}::test_the_model_field_picks_the_pool",
        "prompt": f"{TK}::test_counts_equal_what_the_completion_routes_bill",
        "messages": f"{TK}::test_counts_equal_what_the_completion_routes_bill",
        "add_special_tokens": f"{TK}::test_each_field_changes_the_ids",
        "return_token_strs": f"{TK}::test_counts_equal_what_the_completion_routes_bill",
        "add_generation_prompt": f"{TK}::test_each_field_changes_the_ids",
        "continue_final_message": f"{TK}::test_each_field_changes_the_ids",
        "chat_template_kwargs": f"{TK}::test_each_field_changes_the_ids",
        "tools": f"{TK}::test_each_field_changes_the_ids",
    },
    "DetokenizeRequest": {
        "model": f"{TK}::test_the_model_field_picks_the_pool",
        "tokens": f"{TK}::test_counts_equal_what_the_completion_routes_bill",
    },
    "EmbeddingRequest": {
        "model": f"{EM}::test_the_model_field_picks_the_pool",
        "input": f"{EM}::test_float_and_base64_lists_and_token_ids",
        "encoding_format": f"{EM}::test_float_and_base64_lists_and_token_ids",
        "dimensions": f"{EM}::test_bad_input_is_a_400_naming_the_field",
        "user": f"{EM}::test_user_is_logged_with_the_request_id",
    },
    "GenerateRequest": {
        "inputs": "tests/router/test_tgi_api.py::test_text_generation",
        "parameters": "tests/router/test_tgi_api.py::test_text_generation_details",
        "stream": "tests/router/test_tgi_api.py::test_text_generation_stream",
        "parameters.details": "tests/router/test_tgi_api.py::test_text_generation_details",
        "parameters.return_full_text": f"{RF}::test_tgi_return_full_text",
        "parameters.priority": f"{RF}::test_tgi_priority_reaches_the_engine",
        "parameters.watermark": f"{RF}::test_watermarked_outputs_over_http_are_detected",
        "parameters.adapter_id": "tests/router/test_lora_http.py::test_tgi_adapter_id",
        "parameters.best_of": "tests/router/test_units.py::test_tgi_sampling",
    },
    "LoadLoRAAdapterRequest": {
        "lora_name": "tests/router/test_lora_http.py::test_load_and_unload_at_run_time",
        "lora_path": "tests/router/test_lora_http.py::test_load_and_unload_at_run_time",
    },
    "UnloadLoRAAdapterRequest": {
        "lora_name": "tests/router/test_lora_http.py::test_load_and_unload_at_run_time",
    },
}


def _resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def advertised_fields() -> dict[str, set[str]]:
    """Request body title -> its properties, nested objects' ones as `outer.inner`."""
    spec = app.openapi()
    out: dict[str, set[str]] = {}
    for ops in spec["paths"].values():
        for op in ops.values():
            body = op.get("requestBody")
            if not body:
                continue
            schema = _resolve(spec, next(iter(body["content"].values()))["schema"])
            fields = out.setdefault(schema["title"], set())
            for name, prop in schema.get("properties", {}).items():
                fields.add(name)
                for alt in prop.get("anyOf", [prop]):
                    inner = _resolve(spec, alt)
                    if name in ("parameters", "stream_options") and inner.get("properties"):
                        fields |= {f"{name}.{n}" for n in inner["properties"]}
    return out


def _defined_tests() -> set[str]:
    found = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found.add(f"{rel}::{node.name}")
    return found


def _openai_params(model, **fields):
    req = model.model_validate({"prompt": "x", "messages": [{"role": "user", "content": "x"}], **fields})
    return openai_sampling.sampling_params(req, req.max_tokens, None, None)


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest], ids=lambda m: m.__name__)
@pytest.mark.parametrize("field", sorted(OPENAI_SAMPLING))
def test_openai_sampling_fields_change_the_engine_input(model, field):
    if field not in model.model_fields:
        pytest.skip(f"{model.__name__} has no {field}")
    assert _openai_params(model, **{field: OPENAI_SAMPLING[field]}) != _openai_params(model)


@pytest.mark.parametrize("field", sorted(TGI_SAMPLING))
def test_tgi_sampling_fields_change_the_engine_input(field):
    base = tgi_api.sampling_params(GenerateParameters(), False)
    probed = tgi_api.sampling_params(GenerateParameters(**{field: TGI_SAMPLING[field]}), False)
    assert probed != base


def test_every_advertised_field_acts_or_is_refused():
    fields = advertised_fields()
    defined = _defined_tests()
    unaccounted, stale, missing_tests = [], [], []
    for title, names in sorted(fields.items()):
        shown = SHOWN_BY.get(title, {})
        sampling = {f"parameters.{f}" for f in TGI_SAMPLING} if title == "GenerateRequest" else set(OPENAI_SAMPLING)
        for name in sorted(names):
            if name not in shown and name not in sampling:
                unaccounted.append(f"{title}.{name}")
        stale += [f"{title}.{n}" for n in shown if n not in names]
        missing_tests += [t for t in shown.values() if t not in defined]
    assert not unaccounted, f"accepted but neither a sampling field nor shown by a test: {unaccounted}"
    assert not stale, f"mapped but no longer advertised: {stale}"
    assert not missing_tests, f"named tests that do not exist: {missing_tests}"
