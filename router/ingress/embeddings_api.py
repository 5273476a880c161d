"""OpenAI's `/v1/embeddings`, per model pool: a decoder model run as an embedder.

Each input is one prefill-only engine request (`SamplingParams.pooling`, engine/runner/pooling.py),
batched with the pool's generation traffic: the pool's `pooling_type` ("last" or "mean") pools the
final-norm hidden states of its tokens into one L2-normalised vector. `encoding_format` "base64"
is the vector's little-endian float32 bytes, as OpenAI sends them (the openai SDK asks for it by
default and decodes it itself).

`dimensions`: a decoder model's hidden state is not trained to be cut short (it is no Matryoshka
embedding), so a truncated vector would be a different, undocumented thing. Only the model's own
size is accepted; any other value is a 400 naming the field.
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from pydantic import Field

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from router.ingress.engine_client import new_request_id
from router.ingress.errors import APIError, error_status, parse_body
from router.ingress.openai_api import _log_user
from router.ingress.openai_models import TokenId, _Request
from router.ingress.streams import collect

if TYPE_CHECKING:
    from router.ingress.engine_client import EngineClient

MAX_INPUTS = 256  # inputs in one request (each is a request to the engine, in the router's queue)
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class EmbeddingRequest(_Request):
    model: str | None = None
    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    ) = Field(
        ...,
        description="A string, a list of strings, token ids, or a list of token-id lists; each at most the "
        f"model's context length, at most {MAX_INPUTS} inputs.",
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: a list of numbers; base64: the vector's little-endian float32 bytes."
    )
    dimensions: int | None = Field(
        None, ge=1, description="Accepted only as the model's hidden size (its vectors cannot be shortened)."
    )
    user: str | None = Field(
        None, max_length=256, description="The end user: logged with the request id (Serve's log) for abuse reviews."
    )


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class EmbeddingServing:
    """One pool's embeddings: its engine client, pooling and hidden size."""

    def __init__(self, client: EngineClient, model_name: str, pooling_type: str, hidden_size: int) -> None:
        self.client, self.model_name = client, model_name
        self.pooling_type, self.hidden_size = pooling_type, hidden_size

    def _inputs(self, req: EmbeddingRequest, params: SamplingParams) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) per input, each checked as the engine will check it; errors name `input`."""
        raw = req.input
        items = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else raw
        out = []
        try:
            for item in items:
                text, ids = self.client.inputs.tokenize(item)
                self.client.inputs.check_request(ids, params)
                out.append((text, ids))
        except InvalidRequestError as e:
            raise type(e)(str(e), param="input") from None
        return out

    async def create(self, body: dict, served_as: str | None = None) -> dict:
        req = parse_body(EmbeddingRequest, body)
        if req.dimensions is not None and req.dimensions != self.hidden_size:
            raise InvalidRequestError(
                f"dimensions: this model's embeddings have {self.hidden_size} dimensions and cannot be shortened",
                param="dimensions",
            )
        params = SamplingParams(max_tokens=1, pooling=self.pooling_type)
        n = 1 if isinstance(req.input, str) or isinstance(req.input[0], int) else len(req.input)
        inputs = await self.client.text_work(n, self._inputs, req, params)
        rid, arrival = new_request_id("embd"), time.time()
        _log_user(rid, req.user)
        outs = await collect(
            [
                self.client.generate(f"{rid}-{i}", text, ids, params, arrival, stream=False)
                for i, (text, ids) in enumerate(inputs)
            ]
        )
        data = []
        for i, out in enumerate(outs):
            if out.error is not None or out.embedding is None:
                raise APIError(error_status(out), out.error or "the engine returned no embedding")
            data.append({"object": "embedding", "index": i, "embedding": _encode(out.embedding, req.encoding_format)})
        tokens = sum(len(ids) for _, ids in inputs)
        return {
            "object": "list",
            "data": data,
            "model": served_as or self.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
