"""What a server shares with every LLM-using handler: one token-in/token-out client (one HTTP session over the
backend pool) and the served model's tokenizer, loaded once.

The tokenizer is the model's own (transformers ``AutoTokenizer``): from the ``tokenizer`` setting
(``--tokenizer``) if given, else from the model the backend reports at ``GET /v1/models``: its ``root`` (for
vLLM: the ``--model`` path or hub name, also when it serves under ``--served-model-name``), else its ``id``.
A name taken from the backend is loaded from local files only (a directory, or the Hugging Face cache): a
hub lookup on an offline node retries for about a minute per job, so a missing tokenizer fails at once with
:class:`TokenizerUnavailableError` naming the fix. Only an explicit ``tokenizer`` setting may download.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from typing import TYPE_CHECKING, Any, Iterator, Optional

import aiohttp

from prorl_server.gc_control import note_long_lived_load
from prorl_server.llm.client import LLMClient, LLMUnavailableError
from prorl_server.types import TokenizerFingerprint

if TYPE_CHECKING:
    from prorl_server.balancer import Backend, BackendPool


class TokenizerUnavailableError(OSError):
    """The served model's tokenizer is neither a local directory nor in the Hugging Face cache."""


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
        self._fingerprints: dict[str, TokenizerFingerprint] = {}  # name -> of the tokenizer loaded from it
        self._loading: dict[str, asyncio.Future] = {}
        self._roots: dict[str, str] = {}

    async def tokenizer(self, backend: "Backend") -> Any:
        """The tokenizer of the model ``backend`` serves (loaded in a worker thread, once per name).

        Raises:
            prorl_server.llm.client.LLMUnavailableError: the backend does not answer ``/v1/models``.
            TokenizerUnavailableError: a name from the backend is not loadable from local files, or the
                ``tokenizer`` setting cannot be loaded (``failure_kind="configuration"``: a trainer stops).
        """
        name, local_only = self.tokenizer_name, False
        if name is None:
            name, local_only = await self._served_model_path(backend.address), True
        tok = self._tokenizers.get(name)
        if tok is not None:
            return tok
        fut = self._loading.get(name)
        if fut is None:  # importing transformers takes seconds: in the thread too, not on the event loop
            fut = self._loading[name] = asyncio.ensure_future(asyncio.to_thread(_load_and_fingerprint, name,
                                                                                 local_only))
        try:
            tok, fingerprint = await asyncio.shield(fut)
        except BaseException:
            self._loading.pop(name, None)
            raise
        self._tokenizers[name] = tok
        self._fingerprints[name] = fingerprint
        return tok

    async def tokenizer_info(self, backend: Optional["Backend"]) -> tuple[str, TokenizerFingerprint]:
        """``(name, fingerprint)`` of the tokenizer jobs on ``backend`` use (loaded if it is not yet; the
        fingerprint is computed once, when it loads: :meth:`prorl_server.types.TokenizerFingerprint.of`).
        ``backend`` may be None when the ``tokenizer`` setting names it.

        Raises:
            ValueError: no ``tokenizer`` setting and no ``backend``.
            LLMUnavailableError, TokenizerUnavailableError: as :meth:`tokenizer`.
        """
        if self.tokenizer_name is None and backend is None:
            raise ValueError("no tokenizer setting and no backend: the tokenizer is the served model's")
        name = self.tokenizer_name if self.tokenizer_name is not None else \
            await self._served_model_path(backend.address)
        if name not in self._fingerprints:
            await self.tokenizer(backend)
        return name, self._fingerprints[name]

    async def _served_model_path(self, address: str) -> str:
        """The ``root`` of the first model at ``{address}/v1/models`` (vLLM: the ``--model`` path), else its
        ``id``. Raises LLMUnavailableError when the backend does not answer."""
        if address not in self._roots:
            try:
                async with self.client.session.get(f"{address}/v1/models",
                                                   timeout=aiohttp.ClientTimeout(total=30)) as r:
                    r.raise_for_status()
                    card = (await r.json())["data"][0]
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, IndexError,
                    TypeError) as e:
                raise LLMUnavailableError(f"{address}/v1/models: {e!r}") from e
            self._roots[address] = str(card.get("root") or card["id"])
        return self._roots[address]

    async def close(self) -> None:
        await self.client.close()


_gc_paused = 0  # loads in progress that paused the collector (one thread each)
_gc_lock = threading.Lock()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic collector off while the first load imports transformers and torch (~370k objects): each
    collection it triggered walked the objects imported so far while the event loop waited for the GIL. The
    server's collector control freezes what the load left once the import burst has settled
    (:mod:`prorl_server.gc_control`; :func:`_load_tokenizer` tells it the load ended); reference counting frees
    as usual meanwhile."""
    global _gc_paused
    with _gc_lock:
        if _gc_paused == 0:
            _gc_paused = -1 if not gc.isenabled() else 1  # -1: it was off already, leave it off
            gc.disable()
        elif _gc_paused > 0:
            _gc_paused += 1
    try:
        yield
    finally:
        with _gc_lock:
            if _gc_paused > 0:
                _gc_paused -= 1
                if _gc_paused == 0:
                    gc.enable()
            elif _gc_paused == -1:
                _gc_paused = 0


def _load_tokenizer(name: str, local_only: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained(name)`` with the collector paused (:func:`_collector_paused`);
    ``local_only``: a directory or the HF cache, never the hub.

    Raises:
        TokenizerUnavailableError: ``name`` cannot be loaded (``local_only``: not available locally).
    """
    with _collector_paused():
        tok = _load(name, local_only)
    note_long_lived_load()  # the collector control freezes what the load left (prorl_server.gc_control)
    return tok


def _load_and_fingerprint(name: str, local_only: bool = False) -> tuple[Any, TokenizerFingerprint]:
    """:func:`_load_tokenizer` and the loaded tokenizer's fingerprint (``GET /tokenizer``), in one thread."""
    tok = _load_tokenizer(name, local_only)
    return tok, TokenizerFingerprint.of(tok)


def _load(name: str, local_only: bool) -> Any:
    from transformers import AutoTokenizer

    if not local_only:
        try:
            return AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as e:
            raise TokenizerUnavailableError(f"the tokenizer setting {name!r} cannot be loaded "
                                            f"({type(e).__name__}: {e})") from None
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise TokenizerUnavailableError(
            f"the backend serves model {name!r}, which is neither a local directory nor in the Hugging Face "
            f"cache; start the server with --tokenizer PATH (or the tokenizer setting) naming the model's "
            f"directory ({type(e).__name__}: {e})") from None
