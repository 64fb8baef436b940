"""What a server shares with every LLM-using handler: one token-in/token-out client (one HTTP session over the
backend pool) and the served model's tokenizer, loaded once.

The tokenizer is the model's own (transformers ``AutoTokenizer``): from the ``tokenizer`` setting if given,
else from the model id the backend reports at ``GET /v1/models`` (for vLLM: the ``--model`` path or hub name;
with ``HF_HUB_OFFLINE=1`` it must be a local directory or already cached).
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Optional

from prorl_server.llm_client import LLMClient

if TYPE_CHECKING:
    from prorl_server.balancer import Backend, BackendPool


class LLMContext:
    """Shared LLM resources of one server.

    Args:
        pool: the server's backend pool (failed backends are marked unhealthy there).
        tokenizer: tokenizer path/name; None = ask the backend which model it serves.
        request_timeout_s: per-call timeout of one generation request, seconds.
    """

    def __init__(self, pool: "BackendPool", tokenizer: Optional[str] = None,
                 request_timeout_s: float = 600.0) -> None:
        self.client = LLMClient(pool=pool, request_timeout_s=request_timeout_s)
        self.tokenizer_name = tokenizer
        self._tokenizers: dict[str, Any] = {}
        self._loading: dict[str, asyncio.Future] = {}

    async def tokenizer(self, backend: "Backend") -> Any:
        """The tokenizer of the model ``backend`` serves (loaded in a worker thread, once per name).

        Raises:
            prorl_server.llm_client.LLMUnavailableError: the backend does not answer ``/v1/models``.
            OSError: the tokenizer cannot be loaded from that name.
        """
        name = self.tokenizer_name or (await self.client.model_info(backend.address)).id
        tok = self._tokenizers.get(name)
        if tok is not None:
            return tok
        fut = self._loading.get(name)
        if fut is None:  # importing transformers takes seconds: in the thread too, not on the event loop
            fut = self._loading[name] = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, name))
        try:
            tok = await asyncio.shield(fut)
        except BaseException:
            self._loading.pop(name, None)
            raise
        self._tokenizers[name] = tok
        return tok

    async def close(self) -> None:
        await self.client.close()


def _load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)
