"""A decode step's inputs in preallocated buffers: filled on the host in pinned memory, copied
with non_blocking into device tensors whose addresses never change (a CUDA graph reads them).

One new token per request. Rows past the real batch (up to the graph's bucket) are padding:
they write their K/V into a spare block no request owns and attend to that block alone, so a
padded graph never touches a live sequence's cache.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.layers.attention.metadata import AttentionMetadata
from engine.runner.runner_state import RunnerRequestState


class DecodeInputs:
    def __init__(
        self, max_rows: int, max_blocks: int, block_size: int, sink_block: int, device: torch.device | str
    ) -> None:
        self.device = torch.device(device)
        self.bs, self.sink_block = block_size, sink_block
        pin = self.device.type == "cuda"

        def host(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

        self.h_ids, self.h_pos, self.h_slots = (host(max_rows, dtype=torch.long) for _ in range(3))
        # info rows as the Triton kernel reads them: (first row, new tokens, cached tokens).
        self.h_info = host(max_rows, 3, dtype=torch.int32)
        self.h_info[:, 0] = torch.arange(max_rows, dtype=torch.int32)
        self.h_info[:, 1] = 1
        self.h_table = host(max_rows, max_blocks, dtype=torch.int32)
        self._np = [t.numpy() for t in (self.h_ids, self.h_pos, self.h_slots, self.h_info, self.h_table)]
        self.ids, self.pos, self.slots, self.info, self.table = (
            t.to(self.device) for t in (self.h_ids, self.h_pos, self.h_slots, self.h_info, self.h_table)
        )
        # Set after each copy: the next fill waits on it before rewriting the pinned memory.
        self._copied = torch.cuda.Event() if pin else None

    def meta(self, rows: int) -> AttentionMetadata:
        """Metadata over the first `rows` device rows (views: a graph captured with it replays
        whatever the buffers hold)."""
        return AttentionMetadata(
            block_size=self.bs,
            slot_mapping=self.slots[:rows],
            num_decode_tokens=rows,
            decode_block_table=self.table[:rows],
            decode_info=self.info[:rows],
        )

    def fill(self, states: list[RunnerRequestState], rows: int) -> None:
        """Rows 0..len(states)-1 from the requests (each computes its token at num_computed_tokens),
        rows up to `rows` padding; then one non_blocking copy per buffer."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have left the pinned memory
        ids, pos, slots, info, table = self._np
        bs, n = self.bs, len(states)
        # Whole columns from lists: one numpy assignment per buffer, not one per element.
        nc = [st.num_computed_tokens for st in states]
        ids[:n] = [
            st.prompt_token_ids[c]
            if c < len(st.prompt_token_ids)
            else st.output_token_ids[c - len(st.prompt_token_ids)]
            for st, c in zip(states, nc)
        ]
        pos[:n] = nc
        info[:n, 2] = nc
        slots[:n] = [st.block_ids[c // bs] * bs + c % bs for st, c in zip(states, nc)]
        # Block tables: every row's blocks in one flat list, scattered in one indexed assignment.
        nbs = [c // bs + 1 for c in nc]
        flat = [b for st, nb in zip(states, nbs) for b in st.block_ids[:nb]]
        if flat:
            counts = np.asarray(nbs)
            rows_of = np.repeat(np.arange(n), counts)
            cols_of = np.arange(len(flat)) - np.repeat(np.cumsum(counts) - counts, counts)
            table[rows_of, cols_of] = flat
        ids[n:rows], pos[n:rows], info[n:rows, 2] = 0, 0, 0
        slots[n:rows] = self.sink_block * bs
        table[n:rows, 0] = self.sink_block
        for h, d in (
            (self.h_ids, self.ids),
            (self.h_pos, self.pos),
            (self.h_slots, self.slots),
            (self.h_info, self.info),
            (self.h_table, self.table),
        ):
            d[:rows].copy_(h[:rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
