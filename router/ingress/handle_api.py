"""The ingress's Python handle API (`HandleAPI`, a base of the `Ingress` deployment, so Serve
finds these methods on it): what a `DeploymentHandle` caller uses instead of HTTP. Dicts in and
out, the same bodies as the HTTP routes; a body with `"stream": true` needs
`handle.options(stream=True)` and yields chunk dicts. Also the per-request deadline the HTTP
routes run under, the LoRA adapter changes both surfaces share, and this router replica's routing
figures (tests, debugging, benchmarks). Health, stats and metrics: `pool_reports.py`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable

from router.config import AppConfig
from router.ingress.model_pools import ModelPools
from router.ingress.responses_api import ResponsesAPI
from router.ingress.tgi_api import TGIServing
from router.replica_choice.routing_state import routing_state


class HandleAPI:
    """Methods over the attributes `Ingress.__init__` sets."""

    settings: AppConfig
    pools: ModelPools
    responses: ResponsesAPI
    tgi: TGIServing  # the first pool's

    async def _call(self, coro: Awaitable[Any]) -> Any:
        """Run an API call under the per-request timeout; stream results get a deadline too."""
        deadline = time.monotonic() + self.settings.request_timeout_s
        async with asyncio.timeout_at(asyncio.get_running_loop().time() + self.settings.request_timeout_s):
            result = await coro
        if hasattr(result, "__anext__"):
            return self._with_deadline(result, deadline)
        return result

    async def _with_deadline(self, it: AsyncIterator[dict], deadline: float) -> AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        try:
            while True:
                remaining = deadline - time.monotonic()
                async with asyncio.timeout_at(loop.time() + max(remaining, 0)):
                    try:
                        item = await it.__anext__()
                    except StopAsyncIteration:
                        return
                yield item
        finally:
            await it.aclose()

    # --- generation and text ----------------------------------------------------------------

    async def completions(self, body: dict, tier_hint: str | None = None) -> dict | AsyncIterator[dict]:
        return await self._call(self.pools.completions(body, tier_hint))

    async def chat_completions(self, body: dict, tier_hint: str | None = None) -> dict | AsyncIterator[dict]:
        return await self._call(self.pools.chat_completions(body, tier_hint))

    async def create_response(self, body: dict, tier_hint: str | None = None) -> dict | AsyncIterator[dict]:
        return await self._call(self.responses.create(body, tier_hint))

    async def embeddings(self, body: dict) -> dict:
        return await self._call(self.pools.embeddings(body))

    async def tokenize(self, body: dict) -> dict:
        return await self._call(self.pools.tokenize(body))

    async def detokenize(self, body: dict) -> dict:
        return await self._call(self.pools.detokenize(body))

    async def generate(self, body: dict) -> dict | AsyncIterator[dict]:
        if body.get("stream"):
            return await self._call(self.tgi.generate_stream(body))
        return await self._call(self.tgi.generate(body))

    async def models(self) -> dict:
        return self.pools.models()

    # --- LoRA adapters (router/ingress/lora_adapters.py) -------------------------------------

    async def load_lora_adapter(self, body: dict) -> str:
        """/v1/load_lora_adapter: serve a PEFT LoRA adapter directory under a name (`lora_name`,
        `lora_path`)."""
        return await self._change_adapters("http_load", body)

    async def unload_lora_adapter(self, body: dict) -> str:
        """/v1/unload_lora_adapter: stop serving an adapter (`lora_name`); unknown: AdapterNotFoundError."""
        return await self._change_adapters("http_unload", body)

    async def _change_adapters(self, method: str, body: dict) -> str:
        # Off the loop: checking an adapter reads its files.
        pool = self.pools.lora_pool(None)
        return await asyncio.to_thread(getattr(pool.loras, method), body)

    # --- routing figures ----------------------------------------------------------------------

    def routed_counts(self, pool: str | None = None) -> dict[str, int]:
        """Requests this router replica sent to each engine replica of a pool (None: the first)
        and that ended there (tests, debugging)."""
        return dict(self.pools.get(pool).client.replica_counts)

    def routing_decisions(self) -> dict[str, dict]:
        """Recent replica choices of this router replica, by request id: replica, policy,
        predicted and engine-reported cached prompt tokens (tests, debugging)."""

        return routing_state().log.recent()

    def routing_stats(self) -> dict:
        """Per engine replica: requests routed, predicted and engine-reported cached prompt
        tokens; the decisions' CPU time (benchmarks; /metrics has the same); and the cached
        block hashes the KV index knows per replica."""

        return {**routing_state().log.stats(), "index": routing_state().kv_index.sizes()}
