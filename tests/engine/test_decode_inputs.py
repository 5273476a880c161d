"""The static decode inputs a CUDA graph reads (filled here on CPU: same code, no pinning) and
the graph buckets: padding rows must write only the spare block, real rows the request's slot."""

from __future__ import annotations

from engine.runner.cuda_graph import graph_buckets
from engine.runner.decode_inputs import DecodeInputs
from engine.runner.runner_state import RunnerRequestState


def _state(rid, prompt, out, blocks, nc):
    return RunnerRequestState(rid, prompt, out, None, blocks, nc)


def test_fill_real_rows_then_padding_to_the_spare_block():
    inp = DecodeInputs(max_rows=8, max_blocks=4, block_size=4, sink_block=9, device="cpu")
    a = _state("a", [5, 6, 7], [40, 41, 42], [3, 7], 5)  # computes position 5: output token 42
    b = _state("b", [1, 2, 3, 4, 5], [], [2, 0], 4)  # a one-token prompt chunk at position 4
    inp.fill([a, b], 4)
    assert inp.ids[:4].tolist() == [42, 5, 0, 0]
    assert inp.pos[:4].tolist() == [5, 4, 0, 0]
    assert inp.slots[:4].tolist() == [7 * 4 + 1, 0 * 4 + 0, 9 * 4, 9 * 4]
    assert inp.info[:4].tolist() == [[0, 1, 5], [1, 1, 4], [2, 1, 0], [3, 1, 0]]
    assert inp.table[0, :2].tolist() == [3, 7] and inp.table[1, :2].tolist() == [2, 0]
    assert inp.table[2:4, 0].tolist() == [9, 9]
    # A later, smaller step pads the rows a request used before.
    inp.fill([b], 2)
    assert inp.slots[:2].tolist() == [0, 36] and inp.info[1].tolist() == [1, 1, 0] and inp.table[1, 0] == 9
    meta = inp.meta(2)
    assert meta.num_decode_tokens == 2 and meta.decode_info.data_ptr() == inp.info.data_ptr()
    assert not meta.prefills


def test_graph_buckets():
    assert graph_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    assert graph_buckets(128) == [1, 2, 4, 8, 16, 32, 64, 96, 128]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(1) == [1]
