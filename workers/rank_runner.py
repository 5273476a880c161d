"""What every tensor-parallel rank does with its model runner, wherever the rank lives (rank 0
in the driver, workers/driver_rank.py; ranks 1..tp-1 as actors, workers/worker.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class RankRunner:
    device = None
    runner = None
    tp = None  # engine.distributed.TPGroup
    pp = None  # engine.pipeline_group.PPGroup (pp > 1)

    def _join(
        self, rank: int, tp: int, pp: int, layers: range | None, addr: str, port: int, store: object | None = None
    ) -> None:
        """Join the replica's process groups: the tp group, and at pp > 1 also the world group
        of the stage hops."""
        from workers.process_group import join_group, join_pipeline_groups

        if pp == 1:
            self.tp = join_group(rank, tp, addr, port, self.device, store=store)
        else:
            self.tp, self.pp = join_pipeline_groups(rank, tp, pp, layers, addr, port, self.device, store=store)

    def _apply_prev_sampled(self, prev: dict[str, list[int]]) -> None:
        """The token ids the sampling rank drew last step (ranks that do not sample learn them so)."""
        states = self.runner.states
        for rid, toks in prev.items():
            st = states.get(rid)
            if st is not None:
                st.output_token_ids.extend(toks)

    def _abort_groups(self) -> None:
        from workers.process_group import abort_group

        abort_group(self.tp)
        abort_group(self.pp)

    def _build_runner(self, model_config, cache_config) -> int:
        """Build this rank's model shard (reads only its slices); returns its KV block budget."""
        from engine.runner.model_runner import ModelRunner

        self.runner = ModelRunner(model_config, cache_config, self.device)
        self.runner.load_model()
        return self.runner.num_blocks_for_budget()

    def measure_step_costs(self, max_batch: int, max_k: int) -> dict[tuple[int, int], float]:
        """This rank's part of the verify-step cost table (every rank at once: see ModelRunner)."""
        return self.runner.measure_step_costs(max_batch, max_k)

    def warm_up(self, max_tokens: int, max_logit_rows: int) -> None:
        """This rank's part of the warm-up (every rank at once: the LM head gathers)."""
        self.runner.warm_up(max_tokens, max_logit_rows)

    def init_kv_cache(self, num_blocks: int) -> int:
        self.runner.init_kv_cache(num_blocks)
        return self.runner.bytes_per_block()

    # ---- KV hand-off (disaggregated serving): this rank's heads of whole blocks ----
    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.runner.read_kv_blocks(block_ids)

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """`data`: this rank's KV heads only (the driver cut them out)."""
        self.runner.write_kv_blocks(block_ids, data, all_heads=False)
