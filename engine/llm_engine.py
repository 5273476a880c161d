"""The synchronous engine: text in, text out, one `step()` at a time.

Glues the input processor (tokenize, validate, expand n), the engine core (scheduler +
executor, token ids) and the output processor (detokenize, stop strings, aggregate n).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from engine.choices import POOLING_TYPES
from engine.config import CacheConfig, ParallelConfig, SchedulerConfig
from engine.core.engine_core import EngineCore, StepInFlight
from engine.engine_args import CPU_KV_CACHE_BYTES, EngineArgs
from engine.errors import InvalidRequestError
from engine.kv_transfer.config import KVTransferConfig
from engine.lora.config import LoRAConfig, parse_lora_modules
from engine.lora.registry import AdapterRegistry
from engine.lora.request import LoRARequest
from engine.model_config import ModelConfig, build_model_config
from engine.outputs import EngineCoreOutput, RequestOutput
from engine.pipeline import check_pipeline_features, parse_partition
from engine.request import Request, RequestStatus
from engine.runner.cuda_graph import MAX_GRAPH_BATCH
from engine.runner.executor import ExecutorFactory, in_process_executor
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine.step_threads import StepThreads
from engine.text.input_processor import InputProcessor, PromptInput
from engine.text.output_processor import OutputProcessor


class LLMEngine:
    """`executor_factory` builds the executor: the in-process one by default (tp=1); whoever
    builds a tp>1 engine passes one that spans processes (workers.make_executor)."""

    def __init__(self, args: EngineArgs, executor_factory: ExecutorFactory = in_process_executor) -> None:
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        if args.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {args.pooling_type!r}"
            )
        check_pipeline_features(args)
        self.args = args
        self.model_config: ModelConfig = build_model_config(
            args.model,
            args.dtype,
            torch.device(args.device),
            args.max_model_len,
            args.served_model_name,
            args.quantization,
            args.int8_activations,
        )
        lora = LoRAConfig.from_args(args)
        if lora is not None:
            self.model_config = dataclasses.replace(self.model_config, lora=lora)
        on_gpu = torch.device(args.device).type == "cuda" and args.kv_cache_memory_bytes is None
        cache = CacheConfig(
            args.block_size,
            args.enable_prefix_caching,
            args.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES,
            args.num_blocks,
            args.gpu_memory_utilization if on_gpu else None,
            args.max_num_batched_tokens,
            args.kv_cache_dtype,
            args.kv_offload_bytes,
            args.kv_offload_medium,
            args.kv_offload_dir,
        )
        sched = SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens, self.model_config.max_model_len, args.scheduling_policy
        )
        graphs = torch.device(args.device).type == "cuda" and not args.enforce_eager and args.tensor_parallel_size == 1
        graphs = graphs and args.pipeline_parallel_size == 1
        graphs = graphs and lora is None  # a graph would hold one step's adapter rows
        executor = executor_factory(
            self.model_config,
            cache,
            ParallelConfig(
                args.tensor_parallel_size, args.pipeline_parallel_size, parse_partition(args.pipeline_partition)
            ),
            args.device,
            min(args.max_num_seqs, MAX_GRAPH_BATCH) if graphs else 0,
        )
        spec = SpeculativeConfig.from_value(args.speculative_config)
        if lora is not None and spec is not None and spec.uses_draft_model:
            raise InvalidRequestError(
                f"speculative_config method {spec.method!r} drafts with a model that has no adapters; "
                "with enable_lora use method 'ngram'"
            )
        draft = None
        if spec is not None and spec.uses_draft_model:
            from engine.spec_decode.draft_source import build_draft_proposer

            draft = build_draft_proposer(spec, self.model_config, cache, args.max_num_seqs, args.device, executor)
        threads = None
        if torch.device(args.device).type == "cpu" and args.spare_core_max_tokens > 0:
            threads = StepThreads(torch.get_num_threads(), args.spare_core_max_tokens)
        self.core = EngineCore(
            sched,
            cache,
            executor,
            spec,
            KVTransferConfig.from_value(args.kv_transfer_config),
            draft,
            threads,
            lora,
        )
        if args.warmup:
            executor.warm_up(args.max_num_batched_tokens, args.max_num_seqs)
        # The adapters known by name (engine/lora/registry.py); None: LoRA is off.
        self.loras = AdapterRegistry(lora, self.model_config.hf_config, self.model_config.served_name) if lora else None
        for name, path in parse_lora_modules(args.lora_modules).items():
            self.loras.add_path(name, path)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_config.model_dir)
        self.inputs = InputProcessor(self.tokenizer, self.model_config, args.enable_prefix_caching)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._children: dict[str, list[str]] = {}
        on_cuda_tp1 = torch.device(args.device).type == "cuda" and args.tensor_parallel_size == 1
        on_cuda_tp1 = on_cuda_tp1 and args.pipeline_parallel_size == 1
        self.overlap_text = on_cuda_tp1 if args.overlap_text is None else args.overlap_text
        self._in_flight: StepInFlight | None = None

    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams,
        priority: int = 0,
        prompt_text: str | None = None,
        lora_request: LoRARequest | str | None = None,
    ) -> str:
        """`lora_request`: the adapter to run with, a LoRARequest (added when new) or a known
        adapter's name; None: the base model."""
        request_id = request_id or self.next_request_id()
        if request_id in self._children:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        lora = self.resolve_lora(lora_request)
        text, ids = self.inputs.tokenize_for(prompt, params)
        reqs = self.inputs.make_requests(request_id, ids, params, priority, lora_request=lora)
        self.add_prepared(request_id, prompt_text or text, ids, params, reqs)
        return request_id

    def add_prepared(
        self,
        request_id: str,
        prompt_text: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        reqs: list[Request],
    ) -> None:
        """Adds a request already validated and expanded by `inputs.make_requests`."""
        child_ids = [r.request_id for r in reqs]
        self.outputs.add_request(request_id, prompt_text, prompt_ids, params, child_ids)
        self._children[request_id] = child_ids
        for r in reqs:
            self.core.add_request(r)

    # --- LoRA adapters (engine/lora/) -------------------------------------------------------

    def resolve_lora(self, lora_request: LoRARequest | str | None, register: bool = True) -> LoRARequest | None:
        """A request's adapter: a name must be known here; a LoRARequest is checked against the
        model and, with `register`, known by its name from then on."""
        if lora_request is None:
            return None
        if self.loras is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (enable_lora is off)", param="lora_request")
        if not register and isinstance(lora_request, LoRARequest):
            return self.loras.check(lora_request)
        return self.loras.resolve(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Make an adapter known (checked against the model now; its weights are read when a
        request first uses it)."""
        return self.resolve_lora(lora_request)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoRARequest:
        """vLLM's `/v1/load_lora_adapter`: a name for an adapter directory."""
        if self.loras is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (enable_lora is off)")
        return self.loras.add_path(lora_name, lora_path)

    def remove_lora(self, lora_name: str) -> None:
        """vLLM's `/v1/unload_lora_adapter`: forget an adapter and free its slot and host memory.
        Refused while a request runs or waits with it."""
        if self.loras is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (enable_lora is off)")
        if lora_name not in self.loras.adapters:
            self.loras.remove(lora_name)  # raises AdapterNotFoundError
        lora = self.loras.adapters[lora_name]
        users = [r.request_id for r in self.core.scheduler.requests.values() if r.lora_request == lora]
        if users:
            raise InvalidRequestError(
                f"the LoRA adapter {lora_name!r} is in use by {len(users)} request(s); unload it when they end"
            )
        self.core.scheduler.lora.forget(lora)
        self.loras.remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.loras.list() if self.loras is not None else []

    def abort_request(self, request_id: str) -> None:
        children = self._children.pop(request_id, [])
        self.outputs.abort_request(request_id)
        self.core.abort_requests(children)

    def step(self) -> list[RequestOutput]:
        # Overlapped: the core outputs come back with the next step already running on the device.
        return self.process_core_outputs(self.core_step())

    def core_step(self) -> list[EngineCoreOutput]:
        """One step's token outputs: plain, or overlapped (`overlap_text`) when the step in
        flight is completed and the next one launched before returning. With pipeline
        micro-batches the core keeps its own steps in flight (EngineCore.step), which overlaps
        the text the same way."""
        if not self.overlap_text or self.core.max_in_flight > 1:
            return self.core.step()
        step = self._in_flight or self.core.begin_step()
        self._in_flight = None
        core_outputs = self.core.finish_step(step)
        if self.core.has_work():
            self._in_flight = self.core.begin_step()
        return core_outputs

    @property
    def step_in_flight(self) -> bool:
        return self._in_flight is not None or self.core.num_in_flight > 0

    def process_core_outputs(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Token ids -> text for requests added here; a matched stop string ends its sequence."""
        request_outputs, stop_ids = self.outputs.process_outputs(core_outputs)
        if stop_ids:  # a stop string matched on the text side: free the KV now
            self.core.finish_requests(stop_ids, RequestStatus.FINISHED_STOPPED)
        for out in request_outputs:
            if out.finished:
                self._children.pop(out.request_id, None)
        return request_outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._children) or self.core.has_unfinished_requests() or self.step_in_flight

    def stats(self) -> dict:
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.shutdown()
