"""What a pipeline stage (engine/pipeline.py) keeps of the model: its own decoder layers, the
embedding on the first stage, the final norm and LM head on the last (a tied head keeps the
embedding there too). A layer another stage holds is a parameterless placeholder, so layer
indices and checkpoint names stay the model's own."""

from __future__ import annotations

from torch import nn

from engine.pipeline_group import PPGroup


class MissingLayer(nn.Module):
    """A decoder layer held by another stage."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("a decoder layer of another pipeline stage was called")


def holds_weight(name: str, pp: PPGroup, tied: bool) -> bool:
    """Whether this stage keeps the checkpoint tensor `name` (Hugging Face names)."""
    if pp.size == 1:
        return True
    if name.startswith("model.layers."):
        return pp.holds_layer(int(name.split(".")[2]))
    if name.startswith("model.embed_tokens."):
        return pp.is_first or (pp.is_last and tied)
    if name.startswith("model.norm.") or name.startswith("lm_head."):
        return pp.is_last
    return True
