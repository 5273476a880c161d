"""Runs one step of the model on one worker (one TP rank): inputs, forward, logits, sampling.

Holds the model shard, one KV tensor per layer of its pipeline stage (views bound to the
attention layers) and its own per-request state. A stage before the last receives its input
from the previous stage, sends its output on and returns None; the last stage's rank 0
samples and returns token ids; other ranks return None.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import torch

from engine.config import CacheConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.distributed import get_pp_group, get_tp_group, tp_all_reduce, tp_max
from engine.errors import InvalidRequestError
from engine.kv_offload.rank_io import OffloadIO
from engine.kv_offload.store import OffloadStore
from engine.kv_transfer.block_io import copy_slots, head_slice, read_blocks, write_blocks
from engine.kv_transfer.blocks import KVLayout
from engine.layers.attention.kv_quant import cache_storage_dtype, check_kv_backend, row_width
from engine.layers.quant.int4 import mark_int8_activations
from engine.layers.sampler import Sampler, SamplerOutput, argmax_rows, compute_prompt_logprobs
from engine.lora.batch import lora_context
from engine.model.loader import load_model
from engine.model_config import ModelConfig
from engine.runner import host_to_device
from engine.runner.attn_metadata_builder import StepBatch, build_step_batch
from engine.runner.cpu_malloc import keep_step_memory
from engine.runner.forward_context import forward_context
from engine.runner.kv_memory import allocate_kv_caches
from engine.runner.pooling import pool_step
from engine.runner.runner_state import RunnerRequestState, RunnerStates
from engine.runner.sampling_metadata import SamplingMetadata
from engine.runner.warm_up import warm_up
from engine.spec_decode.verify import accept_drafts

log = logging.getLogger(__name__)

# Logits rows computed at once for prompt logprobs, and reserved by the memory profile.
LOGIT_ROWS = 256


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] without making the host wait for the device: consecutive rows (every decode-only
    step) are a slice, others an index copied without a wait (host_to_device.py): `x[list]` on
    CUDA would wait for the step's forward before the host could go on."""
    if rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0], rows[-1] + 1)):
        return x[rows[0] : rows[-1] + 1]
    return x[host_to_device.tensor(rows, torch.int64, x.device)]


def _none() -> None:  # what a rank that does not sample returns
    return None


def _step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    # Seeded by (seed, output position): reproducible whatever the batch, and across preemption.
    # On the logits' device: a CPU generator cannot draw into CUDA tensors.
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device | str = "cpu",
        cuda_graph_max_batch: int = 0,
    ) -> None:
        self.mc, self.cc = model_config, cache_config
        # > 0: decode steps of up to this many rows replay CUDA graphs (CUDA, tp=1, paged kernel).
        self.cuda_graph_max_batch = cuda_graph_max_batch
        self.graphs = None
        self.device = torch.device(device)
        self.tp = get_tp_group()
        self.pp = get_pp_group()
        # The rank that samples and reports the step: rank 0 of the last pipeline stage.
        self.samples = self.tp.rank == 0 and self.pp.is_last
        self.states = RunnerStates()
        self.sampler = Sampler()
        self.model = None
        self.lora = None  # ModelLoRA (engine/lora/model_lora.py) when the model config turns LoRA on
        self.kv_caches: list[torch.Tensor] = []
        self._kv_buffer = None  # owns the CPU cache's memory
        self.offload: OffloadStore | None = None  # this rank's offload tier (engine/kv_offload/)
        self.offload_io: OffloadIO | None = None  # its I/O, overlapped with each step's forward
        if self.device.type == "cpu":
            keep_step_memory()  # step activations reuse heap memory instead of fresh page faults

    def load_model(self, model: torch.nn.Module | None = None) -> None:
        """`model`: one built already (a speculative draft sharing the target's weights)."""
        self.model = (
            model
            if model is not None
            else load_model(
                self.mc.model_dir,
                self.mc.hf_config,
                self.mc.dtype,
                self.device,
                self.mc.max_model_len,
                self.mc.quantization,
                self.mc.gguf_file,
            )
        )
        if self.mc.int8_activations and model is None:
            if not mark_int8_activations(self.model):
                raise InvalidRequestError("int8_activations: this model has no quantized weight (set quantization)")
        if self.mc.lora is not None and model is None:
            from engine.lora.model_lora import ModelLoRA

            self.lora = ModelLoRA(self.model, self.mc.lora, self.mc.dtype, self.device)
        # Fixed for the model's life: whether step metadata needs padded decode buckets.
        self.uses_decode_buckets = self.model.attention_layers()[0].backend.uses_decode_buckets
        self._eos = list(self.mc.eos_token_ids)

    @property
    def num_kv_heads_local(self) -> int:
        first = next(layer for layer in self.model.model.layers if hasattr(layer, "self_attn"))  # this stage's
        return first.self_attn.qkv_proj.num_kv_heads

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        return cache_storage_dtype(self.cc.kv_cache_dtype, self.mc.dtype)

    def bytes_per_block(self) -> int:
        """Real bytes: an int8 cache's rows carry their scales (kv_quant.py)."""
        elem = torch.tensor([], dtype=self.kv_storage_dtype).element_size()
        width = row_width(self.cc.kv_cache_dtype, self.mc.head_dim)
        return 2 * self.num_local_layers * self.cc.block_size * self.num_kv_heads_local * width * elem

    @property
    def num_local_layers(self) -> int:
        """Decoder layers this rank's stage holds (all of them when pp=1)."""
        return len(self.model.attention_layers())

    def kv_layout(self) -> KVLayout:
        """Over all ranks: every KV head of the model, whatever this rank holds."""
        return KVLayout(
            self.mc.num_layers,
            self.mc.num_kv_heads,
            self.mc.head_dim,
            self.cc.block_size,
            str(self.kv_storage_dtype)[6:],
        )

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's KV heads of these blocks (kv_transfer/block_io.py), a CPU copy."""
        return read_blocks(self.kv_caches, block_ids)

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor, all_heads: bool = True) -> None:
        """`data`: every KV head (this rank writes its own slice), or with `all_heads=False`
        this rank's slice already."""
        write_blocks(self.kv_caches, block_ids, head_slice(data, self.tp.rank, self.tp.size) if all_heads else data)

    def num_blocks_for_budget(self) -> int:
        if self.cc.num_blocks:
            return self.cc.num_blocks
        budget = self.cc.kv_cache_memory_bytes
        if self.device.type == "cuda" and self.cc.gpu_memory_utilization is not None:
            from engine.runner.gpu_memory import kv_budget_from_free_memory

            budget = kv_budget_from_free_memory(self, self.cc.gpu_memory_utilization, self.cc.profile_num_tokens)
        return max(2, budget // self.bytes_per_block())

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_logit_rows: int = LOGIT_ROWS) -> None:
        """One dummy prefill step of `num_tokens` tokens (sequences of at most max_model_len, as
        the scheduler would batch them) and the logits of a full decode batch, on a pool just big
        enough for it, which is freed again: its peak memory is a step's."""
        bs, limit = self.cc.block_size, self.mc.max_model_len
        lens = [limit] * (num_tokens // limit) + ([num_tokens % limit] if num_tokens % limit else [])
        states, next_block = [], 0
        for i, n in enumerate(lens):
            nb = -(-n // bs)
            states.append(
                RunnerRequestState(f"profile-{i}", [0] * n, [], None, list(range(next_block, next_block + nb)), 0)
            )
            next_block += nb
        self.init_kv_cache(next_block)
        batch = build_step_batch(states, lens, bs, self.device, decode_buckets=self.uses_decode_buckets)
        with forward_context(batch.meta):
            hidden = self.model(batch.input_ids, batch.positions, self._dummy_stage_input(batch))
        if self.pp.is_last:
            logits = self.model.compute_logits(hidden[: min(num_tokens, num_logit_rows)]).float()
            torch.log_softmax(logits, dim=-1), torch.softmax(logits, dim=-1)  # the sampler's float32 copies
            del logits
        del hidden
        for attn in self.model.attention_layers():
            attn.kv_cache = None
        self.kv_caches, self._kv_buffer = [], None

    @torch.inference_mode()
    def measure_step_costs(
        self, max_batch: int, max_k: int, context: int = 128, repeats: int = 3
    ) -> dict[tuple[int, int], float]:
        """Seconds (best of `repeats`) of one step of B rows, each with `context` tokens cached
        and 1 + k new ones scored (forward, logits of the 1 + k rows, argmax), for B = 1, 2, 4..
        up to max_batch and k = 0..max_k. Runs on the KV pool before any request uses it.
        Stops growing B once drafts cannot pay even if all were accepted (compute-bound).
        At tp > 1 every rank runs it at once (its forwards are collective)."""
        bs = self.cc.block_size
        num_blocks = self.kv_caches[0].shape[2] - (1 if self.cuda_graph_max_batch else 0)
        table: dict[tuple[int, int], float] = {}
        b = 1
        while b <= max_batch:
            nb = -(-(context + 1 + max_k) // bs)
            if b * nb > num_blocks:
                break
            for k in range(max_k + 1):
                states = [
                    RunnerRequestState(
                        f"cost-{i}", [0] * (context + 1 + k), [], None, list(range(i * nb, (i + 1) * nb)), context
                    )
                    for i in range(b)
                ]
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    batch = build_step_batch(
                        states, [1 + k] * b, bs, self.device, decode_buckets=self.uses_decode_buckets
                    )
                    with forward_context(batch.meta):
                        hidden = self.model(batch.input_ids, batch.positions)
                    rows = [r for last in batch.last_rows for r in range(last - k, last + 1)]
                    logits = self.model.compute_logits(hidden[rows])  # rank 0's only at tp > 1
                    if logits is not None:
                        argmax_rows(logits)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    best = min(best, time.perf_counter() - t0)
                # Every rank keeps the same table (the slowest rank's times), so all take the same
                # early stop below and run the same steps, collectives included.
                table[(b, k)] = tp_max(best)
            # Past the batch where even fully accepted drafts do not pay, larger ones do not either.
            if all((1 + k) * table[(b, 0)] <= 1.03 * table[(b, k)] for k in range(1, max_k + 1)):
                break
            b *= 2
        return table

    def warm_up(self, max_tokens: int, max_logit_rows: int) -> None:
        """Every linear kernel at every row count a step can take (runner/warm_up.py), before any
        request; at tp > 1 every rank at once. Only the last pipeline stage scores logits."""
        rows = max_logit_rows if self.pp.is_last else 0
        r = warm_up(self.model, self.mc.hf_config.hidden_size, self.mc.dtype, self.device, max_tokens, rows)
        log.info("warm-up: %d (weight, row count) shapes in %.2f s", r.shapes, r.seconds)

    def init_kv_cache(self, num_blocks: int) -> None:
        # With graphs, one spare block past the scheduler's takes the padding rows' K/V writes.
        check_kv_backend(self.cc.kv_cache_dtype, self.model.attention_layers()[0].backend.name, self.device)
        shape = (
            2,
            self.num_kv_heads_local,
            num_blocks + (1 if self.cuda_graph_max_batch else 0),
            self.cc.block_size,
            row_width(self.cc.kv_cache_dtype, self.mc.head_dim),
        )
        self.kv_caches, self._kv_buffer = allocate_kv_caches(
            self.num_local_layers, shape, self.kv_storage_dtype, self.device
        )
        for attn, cache in zip(self.model.attention_layers(), self.kv_caches):
            attn.kv_cache = cache
        if self.offload is None and self.offload_slots() > 0:
            self.offload = OffloadStore(
                self.offload_slots(),
                self.bytes_per_block(),
                self.cc.kv_offload_medium,
                self.cc.kv_offload_dir,
                self.tp.rank,
                pin=self.device.type == "cuda",
            )
            self.offload_io = OffloadIO(self.offload, self.device)

    def offload_slots(self) -> int:
        """Blocks the offload tier holds: its byte budget is the replica's, over all ranks."""
        return self.cc.kv_offload_bytes // (self.bytes_per_block() * self.tp.size)

    def close_offload(self) -> None:
        if self.offload_io is not None:
            self.offload_io.close()
            self.offload = self.offload_io = None

    @torch.inference_mode()
    def launch_model(self, so: SchedulerOutput) -> Callable[[], ModelRunnerOutput | None]:
        """Enqueue the step's work and return what completes it. On CUDA the forward, logits and
        sampling are queued without waiting, so the host can do other work (the last step's
        text) while the GPU runs; the returned call waits for the sampled ids. Call it before
        launching the next step: that step reads the tokens it records. The step's offload saves
        and loads (engine/kv_offload/rank_io.py) run beside its forward and end before this
        returns, a failed step's too."""
        if not (so.kv_saves or so.kv_loads):
            return self._launch(so)
        io = self.offload_io.start(self.kv_caches, so.kv_saves, so.kv_loads)
        try:
            complete = self._launch(so)
        finally:
            failed = self.offload_io.finish(io)
        if not failed:
            return complete
        flags = torch.tensor(failed, dtype=torch.int32)
        if self.tp.size > 1:  # every rank ran the same loads; one that failed anywhere failed
            flags = tp_all_reduce(flags.to(self.device))

        def complete_with_loads() -> ModelRunnerOutput | None:
            out = complete()
            if out is not None:
                out.kv_load_failed = [i for i, f in enumerate(flags.tolist()) if f > 0]
            return out

        return complete_with_loads

    def capture_cuda_graphs(self) -> None:
        """After init_kv_cache. Only the Triton paged kernel reads fixed-shape metadata; tp > 1
        all-reduces through a process group a graph cannot hold."""
        if not self.cuda_graph_max_batch or self.device.type != "cuda" or self.tp.size != 1 or self.pp.size != 1:
            return
        if self.model.attention_layers()[0].backend.name != "triton_paged":
            return
        from engine.runner.cuda_graph import DecodeGraphs
        from engine.runner.decode_inputs import DecodeInputs

        max_blocks = -(-self.mc.max_model_len // self.cc.block_size)
        sink = self.kv_caches[0].shape[2] - 1
        inputs = DecodeInputs(self.cuda_graph_max_batch, max_blocks, self.cc.block_size, sink, self.device)
        self.graphs = DecodeGraphs(self.model, inputs, self.cuda_graph_max_batch)
        self.graphs.capture()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.launch_model(so)()

    def _launch(self, so: SchedulerOutput) -> Callable[[], ModelRunnerOutput | None]:
        """The step itself: launch_model less the offload tier's I/O."""
        if so.kv_copies:  # tail hits: before any of this step's KV writes
            copy_slots(self.kv_caches, so.kv_copies)
        self.states.apply(so)
        if self.lora is not None and so.has_lora_changes:
            self.lora.apply(so)
        if so.is_empty:
            return ModelRunnerOutput if self.samples else _none
        rids = list(so.num_scheduled_tokens)
        states = [self.states[r] for r in rids]
        counts = [so.num_scheduled_tokens[r] for r in rids]
        if self.graphs is not None and self.graphs.fits(counts):
            hidden = self.graphs.run(states)
            rows = list(range(len(rids)))
            batch = StepBatch(rids, self.graphs.inputs.ids[: len(rids)], None, None, rows, rows, counts)
        else:
            batch = build_step_batch(
                states, counts, self.cc.block_size, self.device, decode_buckets=self.uses_decode_buckets
            )
            lora = None
            if self.lora is not None:
                slots = [self.states[r].lora_slot for r in batch.request_ids]
                lora = self.lora.batch(slots, batch.starts, batch.counts, self.device)
            with forward_context(batch.meta), lora_context(lora):
                hidden = self.model(batch.input_ids, batch.positions, self._stage_input(batch))
        if not self.pp.is_last:  # the next stage goes on from here
            self.pp.send(hidden)
            for k, st in enumerate(states):
                st.num_computed_tokens += counts[k]
                st.spec_token_ids = []
            return _none
        by_id = {r: self.states[r] for r in batch.request_ids}
        # Rows that produce a token: the last scheduled token reaches the end of the sequence
        # (embedding requests sample nothing: pooling.py makes their vectors, on rank 0).
        sample_idx = [
            k
            for k, r in enumerate(batch.request_ids)
            if by_id[r].num_computed_tokens + batch.counts[k] >= by_id[r].num_tokens
            and by_id[r].sampling_params.pooling is None
        ]
        pooled = pool_step(hidden, batch, by_id) if self.samples else {}
        prompt_lp = self._prompt_logprob_rows(batch, by_id)
        # A request with drafts is scored at its last token and at every draft (1 + k rows).
        rows = [
            row
            for k in sample_idx
            for row in range(
                batch.last_rows[k] - len(by_id[batch.request_ids[k]].spec_token_ids), batch.last_rows[k] + 1
            )
        ]
        num_sample_rows = len(rows)
        logits = self.model.compute_logits(take_rows(hidden, rows)) if rows else None
        prompt_lp = self._prompt_logprobs(hidden, prompt_lp, by_id)
        for k, r in enumerate(batch.request_ids):
            by_id[r].num_computed_tokens += batch.counts[k]
        if not self.samples:
            for st in states:
                st.spec_token_ids = []
            return _none
        sts = [by_id[batch.request_ids[k]] for k in sample_idx]
        res = self._sample_positions(sts, logits[:num_sample_rows], so.grammar_bitmasks) if num_sample_rows else None
        return functools.partial(self._sampled_output, batch, sts, res, prompt_lp, pooled)

    def _stage_input(self, batch: StepBatch) -> torch.Tensor | None:
        """On a stage after the first: the previous stage's output for this step's tokens."""
        if self.pp.is_first:
            return None
        shape = (batch.input_ids.shape[0], self.mc.hf_config.hidden_size)
        return self.pp.recv(shape, self.mc.dtype, self.device)

    def _dummy_stage_input(self, batch: StepBatch) -> torch.Tensor | None:
        """The memory profile's stand-in for a previous stage's output (no peer takes part)."""
        if self.pp.is_first:
            return None
        shape = (batch.input_ids.shape[0], self.mc.hf_config.hidden_size)
        return torch.zeros(shape, dtype=self.mc.dtype, device=self.device)

    def _sample_positions(self, sts: list[RunnerRequestState], logits: torch.Tensor, grammar_bitmasks: dict):
        """One sampler row per scored position: a request's position j (after j drafts) sees
        the drafts before it as output (penalties, min_tokens), draws from the generator of
        output position len(output) + j, so every draw is keyed by the token it decides, and
        takes row j of its grammar's bitmasks (the scheduler's, for these very drafts)."""
        params, prompts, outputs, gens, masks = [], [], [], [], []
        for s in sts:
            seed, n_out = s.sampling_params.seed, len(s.output_token_ids)
            bm = grammar_bitmasks.get(s.request_id)
            for j in range(1 + len(s.spec_token_ids)):
                params.append(s.sampling_params)
                prompts.append(s.prompt_token_ids)
                outputs.append(s.output_token_ids + s.spec_token_ids[:j] if j else s.output_token_ids)
                gens.append(None if seed is None else _step_generator(seed, n_out + j, logits.device))
                masks.append(None if bm is None else bm[j])
        md = SamplingMetadata.build(params, prompts, outputs, gens, [self._eos] * len(params), self.device, masks)
        return self.sampler(logits, md)

    def _prompt_logprob_rows(self, batch, by_id):
        """(request id, hidden rows, target token ids, chunk starts the prompt) for prompt
        positions computed this step."""
        out = []
        for k, r in enumerate(batch.request_ids):
            st = by_id[r]
            if st.sampling_params.prompt_logprobs is None:
                continue
            nc, n, p = st.num_computed_tokens, batch.counts[k], len(st.prompt_token_ids)
            last = min(nc + n, p - 1)  # position p-1 predicts the first output, not a prompt token
            if last <= nc:
                continue
            rows = list(range(batch.starts[k], batch.starts[k] + last - nc))
            out.append((r, rows, st.prompt_token_ids[nc + 1 : last + 1], nc == 0))
        return out

    def _prompt_logprobs(self, hidden, prompt_lp, by_id) -> dict[str, list]:
        """Each request's prompt logprobs of this step, from logits computed LOGIT_ROWS at a time:
        the memory profile reserves that many rows, and a whole chunk's rows at once (up to
        max_num_batched_tokens x the vocabulary in float32) could exceed what the pool left.
        Every rank runs the same chunks (the LM head may be a collective); rank 0 gets {}."""
        got: dict[str, list] = {}
        for r, rows, targets, starts_prompt in prompt_lp:
            k, lps = by_id[r].sampling_params.prompt_logprobs, []
            for i in range(0, len(rows), LOGIT_ROWS):
                logits = self.model.compute_logits(hidden[rows[i : i + LOGIT_ROWS]])
                if logits is not None:
                    lps += compute_prompt_logprobs(logits, targets[i : i + LOGIT_ROWS], k)
            got[r] = ([None] if starts_prompt else []) + lps
        return got

    def _sampled_output(
        self,
        batch,
        sts: list[RunnerRequestState],
        res: SamplerOutput | None,
        prompt_lp,
        pooled: dict,
    ) -> ModelRunnerOutput:
        """The step's output once its sampled ids (and embeddings) are on the host (the one
        wait of a step)."""
        out = ModelRunnerOutput()
        out.embeddings = {r: v.tolist() for r, v in pooled.items()}
        if res is not None:
            tokens = res.sampled_token_ids.tolist()
            row = 0
            for s in sts:
                emitted, lps = accept_drafts(s.spec_token_ids, tokens, res.logprobs, row)
                row += 1 + len(s.spec_token_ids)
                # Rejected drafts: the scheduler rolls num_computed_tokens back and sends it with
                # the request's next step (as it does to ranks that do not sample).
                s.spec_token_ids = []
                s.output_token_ids.extend(emitted)
                out.request_ids.append(s.request_id)
                out.sampled_token_ids.append(emitted)
                out.logprobs.append(lps)
        out.prompt_logprobs.update(prompt_lp)
        sampled = set(out.request_ids)
        for r in batch.request_ids:  # partial prefill chunks: no token this step
            if r not in sampled:
                out.request_ids.append(r)
                out.sampled_token_ids.append([])
                out.logprobs.append(None)
        return out
