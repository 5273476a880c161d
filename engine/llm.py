"""The offline API: `LLM().generate(prompts, params)`, `LLM().chat(messages, params)` and
`LLM().embed(prompts)`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from tqdm.auto import tqdm

from engine.engine_args import EngineArgs
from engine.errors import InvalidRequestError, OrbitalError
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import EmbeddingOutput, RequestOutput
from engine.runner.executor import ExecutorFactory, in_process_executor
from engine.sampling_params import SamplingParams
from engine.text.input_processor import PromptInput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class LLM:
    """Batch generation with continuous batching. `model=None` is the embedded SmolLM2-135M-Instruct.
    tensor_parallel_size > 1 needs `workers.LLM` (or executor_factory=workers.make_executor).
    `speculative_config={"method": "ngram", "num_speculative_tokens": k}` turns on speculative
    decoding (any EngineArgs field is a keyword)."""

    def __init__(
        self, model: str | None = None, executor_factory: ExecutorFactory = in_process_executor, **kwargs: Any
    ) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs), executor_factory)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request` (with enable_lora): one adapter for every prompt or one per prompt
        (None: the base model), as vLLM takes it; a known adapter may be named instead."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one value or one per prompt")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("lora_request must be one value or one per prompt")
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params_list)):
                ids.append(self.engine.add_request(None, p, sp, priority[i] if priority else 0, lora_request=loras[i]))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text, tok_ids = self.engine.inputs.tokenize_chat(conv, **template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": tok_ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(
        self, prompts: PromptInput | Sequence[PromptInput], pooling: str | None = None, use_tqdm: bool = False
    ) -> list[EmbeddingOutput]:
        """One L2-normalised vector per prompt: the final-norm hidden states of its tokens pooled
        by `pooling` ("last" or "mean"; default: the engine's `pooling_type`). Each prompt runs as
        a prefill-only request in the same batches as generation (engine/runner/pooling.py)."""
        params = SamplingParams(max_tokens=1, pooling=pooling or self.engine.args.pooling_type)
        outs = self.generate(prompts, params, use_tqdm)
        failed = next((o for o in outs if o.embedding is None), None)
        if failed is not None:  # too big for the KV pool, or its step failed
            raise (InvalidRequestError if failed.error_kind == "invalid" else OrbitalError)(
                failed.error or "no embedding"
            )
        return [EmbeddingOutput(o.request_id, o.prompt_token_ids, o.embedding, o.num_cached_tokens) for o in outs]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending, done = set(ids), {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        out_tokens = 0
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    done[out.request_id] = out
                    out_tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    bar.set_postfix(out_tok_s=f"{out_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f}")
        bar.close()
        return [done[i] for i in ids]

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Make an adapter known now (checked against the model); see `remove_lora`."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        """Forget an adapter no request uses, freeing its slot and host memory."""
        self.engine.remove_lora(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def stats(self) -> dict:
        """KV blocks used/free/cached, prefix-cache hit rate, KV waste, preemptions, speculative
        decoding (draft and accepted tokens, acceptance rate, mean accepted length)."""
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()
