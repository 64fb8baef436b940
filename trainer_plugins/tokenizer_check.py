"""Tokenizer and chat-template handshake: a trainer refuses a rollout server whose tokenizer is not its policy's.

A rollout server tokenizes every message and renders every prompt with its own tokenizer (``--tokenizer``, or
the model its backend serves). One that loads but is not the policy's gives the policy token ids it never
produces (every turn a vLLM validation error, or worse, ids that exist and mean something else), and one with
the same vocabulary but another chat template (base vs instruct) trains the policy on prompts it never sees,
with no error at all. So each trainer plugin compares ``GET /tokenizer`` (the server's
:class:`prorl_server.types.TokenizerFingerprint`, computed once when its tokenizer loads) with the fingerprint of
its policy's tokenizer, at start and whenever it registers with a new server (a fleet join), and stops with
:class:`TokenizerMismatchError` naming both fingerprints. The verl relay checks per backend it registers
(``?backend=`` its own address); the TRL rollout and verl's ``backends: external`` check each server once.

A server from before the handshake (no ``GET /tokenizer``: 404) is not checked; that is logged once per server.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional

import aiohttp
import pydantic

from prorl_server.types import TokenizerFingerprint, TokenizerResponse
from trainer_plugins.jobs import ConfigurationError

log = logging.getLogger(__name__)


class NotYet(RuntimeError):
    """The server cannot tell its tokenizer now: it has no LLM backend and no ``--tokenizer``, or it does not
    answer (check again later, e.g. at the next call)."""


class TokenizerMismatchError(ConfigurationError):
    """A rollout server's tokenizer or chat template is not the policy's: the message names the server, what
    differs, and both fingerprints."""


async def server_tokenizer(session: aiohttp.ClientSession, server: str, backend: Optional[str] = None,
                           timeout_s: float = 120.0) -> Optional[TokenizerResponse]:
    """``GET {server}/tokenizer`` (``?backend=``): the tokenizer jobs on the server use, or None for a server
    without the endpoint. ``timeout_s`` covers the first load of the tokenizer on the server (seconds).

    Raises:
        NotYet: the server has no backend yet and no ``--tokenizer``, does not answer, or refused the token.
        ConfigurationError: the server cannot say (no tokenizer for its model, an unknown backend).
    """
    url = f"{server.rstrip('/')}/tokenizer"
    try:
        async with session.get(url, params={"backend": backend} if backend else None,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            body = await r.read()
            status = r.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:  # a dead server: the jobs' retries handle it
        raise NotYet(f"rollout server {server} did not answer GET /tokenizer: {e!r}") from None
    text = body[:2000].decode("utf-8", "replace")
    if status == 404 and "unknown_backend" not in text:
        return None  # a server from before the handshake
    if status in (401, 403):  # the jobs' own requests report a refused token (RolloutAuthError), with its fix
        raise NotYet(f"rollout server {server} refused our bearer token (HTTP {status}) at GET /tokenizer")
    if status == 503 and "no_backend" in text:
        raise NotYet(f"rollout server {server} has no LLM backend yet: its tokenizer is the served model's")
    if status != 200:
        raise ConfigurationError(f"rollout server {server} cannot say which tokenizer its jobs use (GET /tokenizer: "
                                 f"HTTP {status}): {text[:500]}")
    try:
        return TokenizerResponse.model_validate_json(body)
    except pydantic.ValidationError as e:
        raise ConfigurationError(f"rollout server {server} answered GET /tokenizer with no fingerprint: "
                                 f"{e.errors()[0]['msg']}") from None


async def check_tokenizer(session: aiohttp.ClientSession, server: str, policy: TokenizerFingerprint,
                          backend: Optional[str] = None, timeout_s: float = 120.0) -> bool:
    """Compare the server's tokenizer with the policy's (``policy``: :meth:`TokenizerFingerprint.of` of the
    trainer's tokenizer). Returns True when they match, False when the server predates the handshake.

    Raises:
        TokenizerMismatchError: they differ (the message names what, and both fingerprints).
        NotYet, ConfigurationError: as :func:`server_tokenizer`.
    """
    answer = await server_tokenizer(session, server, backend, timeout_s)
    if answer is None:
        log.warning("rollout server %s has no GET /tokenizer (an older server): its tokenizer is not checked "
                    "against the policy's", server)
        return False
    differ = policy.differences(answer.fingerprint)
    if differ:
        raise TokenizerMismatchError(
            f"rollout server {server} tokenizes with {answer.name!r}, which is not the policy's tokenizer: the "
            f"{', '.join(differ)} differ. Policy: {policy}. Server: {answer.fingerprint}. Start the rollout "
            "servers with --tokenizer naming the policy's model directory (verl: or set prorl.tokenizer_path / "
            "PRORL_TOKENIZER), with the chat template the policy is trained with")
    return True
