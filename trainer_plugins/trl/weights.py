"""Keep the rollout servers' vLLM backends on the trainer's weights: gather, write, swap.

:class:`WeightPushCallback` is a ``transformers.TrainerCallback``. After every optimizer step
(``on_step_end``):

1. every rank takes part in :func:`gather_full_state_dict` (a collective under FSDP / ZeRO-3: the full state
   dict lands on rank 0); only the main process (``state.is_world_process_zero``) goes on, the others wait at a
   barrier (``torch.distributed.broadcast_object_list`` of rank 0's outcome, so a failed push stops every rank);
2. rank 0 writes one safetensors file with the names ``save_pretrained`` writes (:func:`checkpoint_state_dict`:
   tied weights once under the checkpoint's name, fused MoE experts split back per expert), the version and a
   nonce in its metadata, and its cheap :func:`~trainer_plugins.vllm_weights.weights_digest`;
3. the swap the rollout server orchestrates (:func:`swap_weights`): ``POST {server}/weights/pause`` on every
   rollout server (each pauses its backends in vLLM's keep mode: turns in flight are held, not aborted, and
   new turns wait inside the server), then ``POST {backend}/collective_rpc prorl_load_weights`` once per
   backend (the worker extension of :mod:`trainer_plugins.vllm_weights`), then ``POST {server}/weights/resume``
   on every server with the backends that did not load (the server takes them out of rotation). A lease
   (``lease_s``) bounds the pause: a trainer that dies between pause and resume does not leave the fleet paused.

A rollout server without ``/weights/pause`` (an older one) gets the previous protocol (:func:`push_weights`):
the trainer pauses each backend itself (vLLM's default abort mode: in-flight turns are re-sent by the server's
LLM client, their partial tokens are lost), loads, resets the prefix cache, resumes, and re-registers the
backends that loaded under the new version (``POST /add_llm_server``).

Versions: the backends are registered at ``on_train_begin`` with the trainer's current step. A run resumed from
a checkpoint (``global_step > 0``) first pushes the checkpoint's weights (the vLLM servers still serve what they
were started with) and only then labels them with the resumed step.

Failure: a backend whose load fails (unreachable, no worker extension, a file it cannot read, a digest
mismatch, a prefix-cache reset vLLM reports as failed) keeps serving under its previous version (or is taken out
of rotation by the server's swap); :class:`WeightPushError` names it and vLLM's reason; by default it stops
training (``on_error="raise"``), ``on_error="warn"`` logs it and goes on.

Sources: vLLM's development endpoints (``vllm/entrypoints/serve/dev``: ``/pause?mode=keep|abort``,
``/resume``, ``/reset_prefix_cache`` answering ``{"success": bool}``, ``/collective_rpc``); ProRL Agent paper,
section 3.3; ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` (full state dict of FSDP1/FSDP2
modules); transformers' ``remove_tied_weights_from_state_dict`` / ``revert_weight_conversion`` (what
``save_pretrained`` writes).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import aiohttp

from trainer_plugins.client import FleetRegistrar, register_backends
from trainer_plugins.fleet import Fleet
from trainer_plugins.vllm_weights import weights_digest

log = logging.getLogger(__name__)

RPC_METHOD = "prorl_load_weights"
KV_MODES = ("keep", "recompute")


class WeightPushError(RuntimeError):
    """At least one backend did not load the new weights. ``failed``: ``{backend: reason}``; ``pushed``:
    backends that did (serving ``version``); ``version``: the version that was pushed."""

    def __init__(self, message: str, failed: Mapping[str, str], pushed: Sequence[str], version: int) -> None:
        super().__init__(message)
        self.failed = dict(failed)
        self.pushed = list(pushed)
        self.version = version


class SwapRefusedError(RuntimeError):
    """A rollout server refused ``/weights/pause`` (another swap holds the lease, a bad token, a server error).
    Nothing was loaded; the servers that had paused were resumed under their previous version."""


@dataclass
class PushReport:
    """One push. ``version``; ``path`` of the weights file and its ``bytes``; ``pushed`` backends; ``failed``
    ``{backend: reason}``; ``mode``: ``"swap"`` (the rollout servers' pause/resume) or ``"legacy"`` (the
    trainer pauses each backend); seconds: ``gather_s`` (full state dict), ``save_s`` (writing the file and its
    digest), ``pause_s`` (``/weights/pause`` round trip, slowest server), ``load_s`` (load into every
    backend, slowest), ``resume_s`` (``/weights/resume``, slowest) or ``register_s`` (legacy),
    ``sync_s`` = pause + load + resume (how long generation was held), ``total_s``; ``held_s``: the servers'
    own pause-to-resume time (slowest); ``dropped_jobs`` (older than ``max_staleness``, dropped at pause);
    ``held_calls``: LLM calls in flight at the backends when the servers paused them (held, not aborted);
    ``tokens_discarded``: generated tokens the servers have thrown away since they started (aborted turns that
    were re-sent; the resume's answer, summed over the servers; None when no server reports it);
    ``jobs_in_flight``: the trainer's rollout jobs still running when the swap began."""

    version: int
    path: str
    pushed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    mode: str = "swap"
    bytes: int = 0
    gather_s: float = 0.0
    save_s: float = 0.0
    pause_s: float = 0.0
    load_s: float = 0.0
    resume_s: float = 0.0
    register_s: float = 0.0
    sync_s: float = 0.0
    total_s: float = 0.0
    held_s: Optional[float] = None
    dropped_jobs: int = 0
    held_calls: int = 0
    tokens_discarded: Optional[int] = None
    jobs_in_flight: Optional[int] = None

    @property
    def s_per_gb(self) -> Optional[float]:
        """Seconds of the whole push (gather, write, swap) per GB (1e9 bytes) of weights file."""
        return self.total_s / (self.bytes / 1e9) if self.bytes else None


# ---------------------------------------------------------------------------------------------- the file
def _unwrap(model: Any) -> Any:
    """The model under accelerate / DDP wrappers (``module``); an FSDP1 wrapper is kept (its state dict is
    gathered through it); PEFT models are not merged here."""
    import torch

    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:  # pragma: no cover - torch without distributed
        FSDP1 = ()
    while (not isinstance(model, FSDP1) and isinstance(getattr(model, "module", None), torch.nn.Module)
           and model.module is not model):
        model = model.module
    return model


def _hf_model(model: Any) -> Any:
    """The Hugging Face model inside an FSDP1 wrapper (names and configs live there)."""
    inner = getattr(model, "_fsdp_wrapped_module", None)
    return _hf_model(inner) if inner is not None else model


def _is_sharded(model: Any) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, FSDP1) or any(isinstance(p, DTensor) for p in model.parameters())


def gather_full_state_dict(model: Any) -> dict:
    """The model's full, unsharded state dict on the main process, as CPU tensors (Hugging Face names).

    A collective when the model is sharded: every rank must call it. FSDP1/FSDP2 modules go through
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True, cpu_offload=True)``
    (rank 0 gets every tensor, the other ranks an empty dict); DeepSpeed ZeRO-3 partitioned parameters are
    gathered with ``deepspeed.zero.GatheredParameters`` (not exercised here: no DeepSpeed); a plain or
    DDP-wrapped model returns its own ``state_dict()`` (no copy).

    Returns:
        ``{name: tensor}``; empty on ranks other than 0 for a sharded model.
    """
    model = _unwrap(model)
    if _is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):  # DeepSpeed ZeRO-3: parameters are partitioned in place
        import deepspeed
        import torch.distributed as dist

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            main = not dist.is_initialized() or dist.get_rank() == 0
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if main else {}
    return model.state_dict()


def checkpoint_state_dict(model: Any, state_dict: Mapping[str, Any]) -> dict:
    """``state_dict`` with the names and layout ``save_pretrained`` writes, which the vLLM server's checkpoint
    has: tied weights once, under the name the model keeps on load (``model.embed_tokens.weight``, not
    ``lm_head.weight``: transformers' ``remove_tied_weights_from_state_dict``, then the model's declared tied
    keys for a gathered dict whose copies no longer share storage), and weight conversions reverted (fused
    MoE experts ``mlp.experts.gate_up_proj`` [E, 2I, H] back to per-expert ``experts.{e}.gate_proj.weight``
    ...: ``revert_weight_conversion``). A model that is not a Hugging Face ``PreTrainedModel`` is returned as
    it is, tied aliases removed by storage (``safetensors``' rule)."""
    model = _hf_model(_unwrap(model))
    sd = dict(state_dict)
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # pragma: no cover - transformers is installed with the LLM tier
        PreTrainedModel = None
    if PreTrainedModel is None or not isinstance(model, PreTrainedModel):
        from safetensors.torch import _remove_duplicate_names

        for _kept, dropped in _remove_duplicate_names(sd).items():
            for name in dropped:
                sd.pop(name, None)
        return sd
    sd = remove_tied_weights_from_state_dict(sd, model)
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in (tied.items() if isinstance(tied, Mapping) else ()):
        if target in sd and source in sd:
            sd.pop(target)
    return revert_weight_conversion(model, sd)


def save_weights(model: Any, path: Union[str, os.PathLike], *, state_dict: Optional[Mapping[str, Any]] = None,
                 metadata: Optional[Mapping[str, str]] = None) -> str:
    """Write ``model``'s weights (or ``state_dict``, e.g. from :func:`gather_full_state_dict`) to one
    safetensors file with the checkpoint's names (:func:`checkpoint_state_dict`), atomically (written beside
    it, then renamed: a reader never sees half a file), with ``metadata`` and a random ``prorl_nonce`` in its
    header (so a file of another push never has the same digest).

    Returns:
        The file's :func:`~trainer_plugins.vllm_weights.weights_digest` (``prorl-sampled-v1:<hex>``): what
        the vLLM worker checks before loading, without reading the whole file again.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = checkpoint_state_dict(model, model.state_dict() if state_dict is None else state_dict)
    sd = {k: v.detach().contiguous() for k, v in sd.items()}
    meta = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}, "prorl_nonce": uuid.uuid4().hex}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(sd, str(tmp), metadata=meta)
    digest = weights_digest(tmp)
    os.replace(tmp, path)
    return digest


# ---------------------------------------------------------------------------------------------- HTTP
async def _post(session: aiohttp.ClientSession, url: str, timeout_s: float, **kwargs: Any) -> Any:
    async with session.post(url, timeout=aiohttp.ClientTimeout(total=timeout_s), **kwargs) as r:
        text = await r.text()
        if r.status != 200:
            raise RuntimeError(f"POST {url} answered HTTP {r.status}: {text[:1000]}")
        return text


class _HTTPStatusError(RuntimeError):
    def __init__(self, message: str, status: int, body: Any) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


async def _call_json(session: aiohttp.ClientSession, method: str, url: str, timeout_s: float,
                     **kwargs: Any) -> Any:
    async with session.request(method, url, timeout=aiohttp.ClientTimeout(total=timeout_s), **kwargs) as r:
        text = await r.text()
        try:
            body = json.loads(text) if text else None
        except ValueError:
            body = None
        if r.status != 200:
            raise _HTTPStatusError(f"{method} {url} answered HTTP {r.status}: {text[:1000]}", r.status, body)
        return body


async def reset_prefix_cache(session: aiohttp.ClientSession, backend: str, timeout_s: float = 300.0) -> None:
    """``POST {backend}/reset_prefix_cache``.

    Raises:
        RuntimeError: HTTP error, or vLLM answered ``{"success": false}`` (blocks still held, e.g. by requests
            paused in keep mode): cached KV computed with the old weights would be reused.
    """
    text = await _post(session, f"{backend}/reset_prefix_cache", timeout_s)
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    if isinstance(body, Mapping) and body.get("success") is False:
        raise RuntimeError(f"{backend}/reset_prefix_cache answered success=false: the prefix cache still holds KV "
                           "computed with the old weights (blocks held by running or paused requests)")


async def load_into_backend(session: aiohttp.ClientSession, backend: str, path: str, digest: str = "", *,
                            pause: bool = True, reset_cache: Optional[bool] = None,
                            timeout_s: float = 300.0) -> dict:
    """Load the weights file into one vLLM backend (``POST /collective_rpc prorl_load_weights``).

    Args:
        pause: pause the backend first (vLLM's default abort mode) and resume it afterwards (the legacy
            protocol); False inside a rollout server's swap (the server paused it).
        reset_cache: ``POST /reset_prefix_cache`` after the load (default: when ``pause``; inside a swap the
            server does it for ``kv="recompute"``).

    Returns:
        The first worker's load report (``loaded``, ``load_s``, ``bytes``, ...).

    Raises:
        RuntimeError: a step failed (the message has vLLM's answer), a failed prefix-cache reset included;
            with ``pause`` the backend is resumed in every case.
    """
    reset_cache = pause if reset_cache is None else reset_cache
    if pause:
        await _post(session, f"{backend}/pause", timeout_s)
    try:
        text = await _post(session, f"{backend}/collective_rpc", timeout_s,
                           json={"method": RPC_METHOD, "args": [str(path), digest], "timeout": timeout_s})
        results = (json.loads(text) or {}).get("results") if text else None
        if not isinstance(results, list) or not results:
            raise RuntimeError(f"{backend}/collective_rpc {RPC_METHOD} gave no result ({text[:300]!r}): is vLLM "
                               f"started with --worker-extension-cls trainer_plugins.vllm_weights."
                               f"WeightLoaderExtension?")
        failed = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
        if failed:
            why = failed[0].get("error") if isinstance(failed[0], dict) else failed[0]
            raise RuntimeError(f"{backend} did not load {path}: {why}")
        if reset_cache:
            await reset_prefix_cache(session, backend, timeout_s)
        return results[0]
    finally:
        if pause:
            await _resume(session, backend, timeout_s)


async def _resume(session: aiohttp.ClientSession, backend: str, timeout_s: float, attempts: int = 3) -> None:
    # A backend left paused would hold every later turn: a dropped keep-alive connection is retried.
    for k in range(attempts):
        try:
            await _post(session, f"{backend}/resume", timeout_s)
            return
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, OSError) as e:
            if k == attempts - 1:
                log.warning("could not resume %s after a weight load: %r", backend, e)
            else:
                await asyncio.sleep(0.2)


def _per_server(backends: Union[Sequence[str], Mapping[str, Sequence[str]]],
                servers: Sequence[str]) -> dict[str, list[str]]:
    return ({s: list(backends.get(s, ())) for s in servers} if isinstance(backends, Mapping)
            else {s: list(backends) for s in servers})


def _push_error(report: PushReport, n: int, what: str) -> WeightPushError:
    why = "; ".join(f"{b}: {r}" for b, r in report.failed.items())
    return WeightPushError(f"weights v{report.version} ({report.path}) were not loaded by {len(report.failed)} of "
                           f"{n} backend(s), which {what}: {why}", report.failed, report.pushed, report.version)


async def push_weights(session: aiohttp.ClientSession, path: str, version: int,
                       backends: Union[Sequence[str], Mapping[str, Sequence[str]]], servers: Sequence[str], *,
                       sha256: str = "", headers: Optional[Mapping[str, str]] = None, pause: bool = True,
                       timeout_s: float = 300.0) -> PushReport:
    """The legacy protocol, for rollout servers without ``/weights/pause``: load ``path`` into every backend
    (each paused by the trainer in vLLM's abort mode) and re-register those that loaded it with every rollout
    server under ``weight_version=version``.

    Args:
        backends: vLLM base URLs (registered with every server), or ``{server_url: [backend, ...]}``.
        servers: rollout server URLs. headers: for the rollout servers (bearer token).
        sha256: the file's digest (:func:`save_weights`' answer, or a full SHA-256).

    Raises:
        WeightPushError: a backend failed (the others are registered with ``version``; the failed ones keep
            their version). RuntimeError: a rollout server refused the registration.
    """
    t0 = time.monotonic()
    per_server = _per_server(backends, servers)
    unique = list(dict.fromkeys(b for bs in per_server.values() for b in bs))
    report = PushReport(version=version, path=str(path), mode="legacy")
    results = await asyncio.gather(*(load_into_backend(session, b, path, sha256, pause=pause, timeout_s=timeout_s)
                                     for b in unique), return_exceptions=True)
    for b, res in zip(unique, results):
        if isinstance(res, BaseException):
            report.failed[b] = f"{type(res).__name__}: {res}"
        else:
            report.pushed.append(b)
    report.load_s = time.monotonic() - t0
    t1 = time.monotonic()
    await asyncio.gather(*(register_backends(session, s, [b for b in bs if b in report.pushed], version, clear=False,
                                             headers=headers)
                           for s, bs in per_server.items() if any(b in report.pushed for b in bs)))
    report.register_s = time.monotonic() - t1
    report.total_s = report.sync_s = time.monotonic() - t0
    if report.failed:
        raise _push_error(report, len(unique), "stay registered with their previous version")
    return report


async def server_supports_swap(session: aiohttp.ClientSession, server: str,
                               headers: Optional[Mapping[str, str]] = None, timeout_s: float = 30.0) -> bool:
    """Whether a rollout server has the swap endpoints (``GET /weights`` answers 200; an older server 404 or
    405)."""
    try:
        await _call_json(session, "GET", f"{server}/weights", timeout_s, headers=dict(headers or {}))
        return True
    except _HTTPStatusError as e:
        if e.status in (404, 405):
            return False
        raise


async def swap_weights(session: aiohttp.ClientSession, path: str, version: int,
                       backends: Union[Sequence[str], Mapping[str, Sequence[str]]], servers: Sequence[str], *,
                       digest: str = "", headers: Optional[Mapping[str, str]] = None, kv: str = "keep",
                       max_staleness: Optional[int] = None, lease_s: float = 300.0,
                       previous_version: Optional[int] = None, timeout_s: float = 300.0) -> PushReport:
    """The swap the rollout servers orchestrate (module docstring, step 3): pause on every server, load once
    per backend, resume on every server.

    Args:
        backends: vLLM base URLs shared by every server, or ``{server_url: [backend, ...]}``.
        kv: ``"keep"`` (in-flight requests keep their KV and go on under the new weights; their later tokens
            carry the new version) or ``"recompute"`` (the servers abort and re-send them, keeping their tokens,
            and reset the prefix cache: no token comes from KV computed under the old weights).
        max_staleness: jobs whose oldest token is older than ``version - max_staleness`` are dropped at pause
            (counted in ``dropped_jobs``). lease_s: the servers resume by themselves after this many seconds.
        previous_version: the version the backends serve now (used to resume the servers that had paused
            when another one refused to: nothing changes for them).

    Returns:
        A :class:`PushReport` (``mode="swap"``).

    Raises:
        SwapRefusedError: a server refused to pause (nothing was loaded).
        WeightPushError: a backend did not load (the servers were told, and took it out of rotation), or a
            server's lease expired before resume (the backends that loaded are then re-registered under
            ``version``: they serve the new weights).
    """
    if kv not in KV_MODES:
        raise ValueError(f"kv must be one of {KV_MODES}, got {kv!r}")
    hdrs = dict(headers or {})
    per_server = _per_server(backends, servers)
    unique = list(dict.fromkeys(b for bs in per_server.values() for b in bs))
    report = PushReport(version=version, path=str(path), mode="swap")
    t0 = time.monotonic()

    async def pause(server: str) -> Any:
        t = time.monotonic()
        body = await _call_json(session, "POST", f"{server}/weights/pause", timeout_s, headers=hdrs,
                                json={"weight_version": version, "kv": kv, "max_staleness": max_staleness,
                                      "lease_s": lease_s})
        return body, time.monotonic() - t

    answers = await asyncio.gather(*(pause(s) for s in servers), return_exceptions=True)
    paused = {s: a[0] for s, a in zip(servers, answers) if not isinstance(a, BaseException)}
    refused = {s: a for s, a in zip(servers, answers) if isinstance(a, BaseException)}
    report.pause_s = max((a[1] for a in answers if not isinstance(a, BaseException)), default=0.0)
    if refused:
        # No backend is loaded while a server still sends it turns: put the paused ones back as they were.
        undo = previous_version if previous_version is not None else version - 1
        await asyncio.gather(*(_call_json(session, "POST", f"{s}/weights/resume", timeout_s, headers=hdrs,
                                          json={"swap_id": a.get("swap_id"), "weight_version": undo, "failed": {}})
                               for s, a in paused.items()), return_exceptions=True)
        why = "; ".join(f"{s}: {e}" for s, e in refused.items())
        raise SwapRefusedError(f"weights v{version}: {len(refused)} rollout server(s) refused to pause ({why}); "
                               "nothing was loaded")
    not_paused: dict[str, str] = {}
    for s, a in paused.items():
        report.dropped_jobs += int((a or {}).get("dropped_jobs") or 0)
        report.held_calls += int((a or {}).get("held_calls") or 0)
        for b, st in ((a or {}).get("backends") or {}).items():
            if st != "paused":
                not_paused[b] = f"{s} could not pause it: {st}"
    t1 = time.monotonic()
    to_load = [b for b in unique if b not in not_paused]
    results = await asyncio.gather(*(load_into_backend(session, b, path, digest, pause=False, reset_cache=False,
                                                       timeout_s=timeout_s) for b in to_load),
                                   return_exceptions=True)
    report.failed.update(not_paused)
    for b, res in zip(to_load, results):
        if isinstance(res, BaseException):
            report.failed[b] = f"{type(res).__name__}: {res}"
        else:
            report.pushed.append(b)
    report.load_s = time.monotonic() - t1

    async def resume(server: str, answer: Mapping[str, Any]) -> Any:
        t = time.monotonic()
        failed = {b: r for b, r in report.failed.items() if b in per_server[server] or not per_server[server]}
        body = await _call_json(session, "POST", f"{server}/weights/resume", timeout_s, headers=hdrs,
                                json={"swap_id": answer.get("swap_id"), "weight_version": version, "failed": failed})
        return body, time.monotonic() - t

    t2 = time.monotonic()
    answers = await asyncio.gather(*(resume(s, a or {}) for s, a in paused.items()), return_exceptions=True)
    report.resume_s = time.monotonic() - t2
    expired: dict[str, str] = {}
    for (s, _), a in zip(paused.items(), answers):
        if isinstance(a, BaseException):
            expired[s] = f"{type(a).__name__}: {a}"
            continue
        body = a[0] or {}
        if body.get("held_s") is not None:
            report.held_s = max(report.held_s or 0.0, float(body["held_s"]))
        if body.get("tokens_discarded") is not None:
            report.tokens_discarded = (report.tokens_discarded or 0) + int(body["tokens_discarded"])
        for b, st in (body.get("backends") or {}).items():
            if st != "resumed" and b not in report.failed:
                log.warning("rollout server %s could not resume %s after weights v%d: %s", s, b, version, st)
    report.sync_s = time.monotonic() - t0
    if expired:
        # The lease ran out: those servers resumed the backends under the old version, but the ones that
        # loaded serve the new weights. Label them with what they serve (the legacy registration).
        await asyncio.gather(*(register_backends(session, s, [b for b in per_server[s] if b in report.pushed],
                                                 version, clear=False, headers=hdrs)
                               for s in expired if any(b in report.pushed for b in per_server[s])),
                             return_exceptions=True)
        why = "; ".join(f"{s}: {e}" for s, e in expired.items())
        raise WeightPushError(f"weights v{version}: {len(expired)} rollout server(s) did not accept the resume "
                              f"({why}); the backends that loaded were re-registered under v{version} (raise "
                              f"lease_s above the {report.sync_s:.1f} s this swap took)", report.failed,
                              report.pushed, version)
    report.total_s = time.monotonic() - t0
    if report.failed:
        raise _push_error(report, len(unique), "the rollout servers took out of rotation")
    return report


def _callback_base():
    try:
        from transformers import TrainerCallback
    except ImportError:  # pragma: no cover - transformers is installed with the LLM tier
        return object
    return TrainerCallback


class WeightPushCallback(_callback_base()):  # type: ignore[misc]
    """``transformers.TrainerCallback`` that keeps the rollout servers' vLLM backends on the trainer's weights
    (see the module docstring).

    Args:
        rollout: the :class:`~trainer_plugins.trl.rollout.ProRLRollout` given to ``GRPOTrainer`` (its rollout
            servers, token and event loop are used; its ``weight_version`` is advanced after each push).
        backends: the trainer's vLLM base URLs (registered with every rollout server), ``{server: [backends]}``,
            or None for the ``llm_backends`` of servers.json.
        weights_dir: where weight files are written (readable by the vLLM workers: same node or a shared file
            system). Default: ``<output_dir>/prorl-weights``.
        keep: how many weight files to keep (older ones are deleted after a successful push).
        on_error: ``"raise"`` (stop training) or ``"warn"`` after a :class:`WeightPushError`.
        protocol: ``"auto"`` (the servers' swap when every rollout server has ``/weights``, else the legacy
            per-backend pause), ``"swap"`` or ``"legacy"``.
        kv, max_staleness, lease_s: the swap's (:func:`swap_weights`). ``max_staleness`` None: the rollout's
            :attr:`~trainer_plugins.trl.rollout.ProRLRollout.staleness_bound` (with ``prefetch = k``, the ``k``
            steps prefetch lags by; none without prefetch); given, it is also the rollout's bound when the
            rollout has none of its own. After each push the rollout's prefetched batches past the bound are
            cancelled and submitted again, and at ``on_train_end`` every prefetched batch is cancelled
            (:meth:`~trainer_plugins.trl.rollout.ProRLRollout.cancel_stale`, ``cancel_pending``).
        pause: legacy protocol only: pause each backend around the load.
        timeout_s: per HTTP call, seconds.

    ``reports`` lists a :class:`PushReport` per push (on the main process).
    """

    def __init__(self, rollout: Any, backends: Union[None, Sequence[str], Mapping[str, Sequence[str]]] = None, *,
                 weights_dir: Optional[Union[str, os.PathLike]] = None, keep: int = 2, on_error: str = "raise",
                 protocol: str = "auto", kv: str = "keep", max_staleness: Optional[int] = None,
                 lease_s: float = 300.0, pause: bool = True, timeout_s: float = 300.0) -> None:
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        if protocol not in ("auto", "swap", "legacy"):
            raise ValueError(f"protocol must be 'auto', 'swap' or 'legacy', got {protocol!r}")
        if kv not in KV_MODES:
            raise ValueError(f"kv must be one of {KV_MODES}, got {kv!r}")
        self.rollout = rollout
        if backends is None:
            backends = {s: list(b) for s, b in rollout.server_backends.items()}
            if not any(backends.values()):
                raise ValueError("no vLLM backend to push weights to: pass backends=[...] or use a servers.json "
                                 "that lists llm_backends")
        self.backends = backends
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.keep = max(1, int(keep))
        self.on_error = on_error
        self.protocol = protocol
        self.kv = kv
        if max_staleness is not None:
            # the rules ProRLRollout applies to its own bound: this one reaches the rollout and the servers too
            if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0:
                raise ValueError(f"max_staleness must be an int >= 0 or None, got {max_staleness!r}")
            if max_staleness == 0 and getattr(rollout, "prefetch", 0):
                raise ValueError(f"max_staleness=0 with the rollout's prefetch={rollout.prefetch!r} would cancel "
                                 "every prefetched batch: use prefetch=0 for on-policy training, or max_staleness >= 1")
            own = getattr(rollout, "max_staleness", None)
            if own is not None and own != max_staleness:
                raise ValueError(f"max_staleness={max_staleness!r} here and {own!r} on the rollout: the servers' drop "
                                 "and the rollout's cancel must use one bound; set it in one place")
        self.max_staleness = max_staleness
        if max_staleness is not None and getattr(rollout, "max_staleness", 0) is None:
            rollout.max_staleness = max_staleness  # one bound: the servers' drop and the rollout's agree
        self.lease_s = lease_s
        self.pause = pause
        self.timeout_s = timeout_s
        self.reports: list[PushReport] = []
        self._files: list[Path] = []
        #: with a fleet (the rollout's servers are a fleet directory) and one backend list: registers the
        #: backends, at the current version, with rollout servers that join later (issue #24)
        self.registrar: Optional[FleetRegistrar] = None
        self._follower: Optional[asyncio.Task] = None

    @property
    def staleness_bound(self) -> Optional[int]:
        """The ``max_staleness`` each swap sends: this callback's, else the rollout's bound (see the class)."""
        if self.max_staleness is not None:
            return self.max_staleness
        return getattr(self.rollout, "staleness_bound", None)

    def _dir(self, args: Any) -> Path:
        if self.weights_dir is None:
            self.weights_dir = Path(getattr(args, "output_dir", None) or ".") / "prorl-weights"
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        return self.weights_dir

    def _all_backends(self) -> list[str]:
        if isinstance(self.backends, Mapping):
            return list(dict.fromkeys(b for bs in self.backends.values() for b in bs))
        return list(self.backends)

    async def _register(self, version: int) -> None:
        servers = list(self.rollout.urls)  # a fleet: its members of this moment (joiners: the registrar)
        async with aiohttp.ClientSession() as session:
            for server in servers:
                bs = self.backends.get(server, ()) if isinstance(self.backends, Mapping) else self.backends
                if bs:
                    await register_backends(session, server, list(bs), version, clear=False,
                                            headers=self.rollout.headers)
        self._follow(version, servers)

    async def _register_one(self, server: str, backends: Sequence[str], version: int) -> None:
        async with aiohttp.ClientSession() as session:
            await register_backends(session, server, list(backends), version, clear=False,
                                    headers=self.rollout.headers)

    def _follow(self, version: int, registered: Sequence[str]) -> None:
        """With a fleet: from now on members that join get the backends at ``version`` (``registered``: the
        members that have them already). Runs on the rollout's event loop."""
        fleet = self.rollout.urls
        if not isinstance(fleet, Fleet) or isinstance(self.backends, Mapping):
            return  # a fixed server list; or per-server backends, which name no server that joins later
        if self.registrar is None:
            self.registrar = FleetRegistrar(fleet, self._register_one)
        self.registrar.set(self.backends, version, registered=registered)
        if self._follower is None or self._follower.done():
            self._follower = asyncio.ensure_future(self.registrar.follow())

    async def _followed(self, version: int, servers: Sequence[str]) -> None:
        self._follow(version, servers)

    async def _resolve_protocol(self) -> str:
        if self.protocol != "auto":
            return self.protocol
        async with aiohttp.ClientSession() as session:
            flags = [await server_supports_swap(session, s, self.rollout.headers) for s in self.rollout.urls]
        if all(flags):
            return "swap"
        log.warning("rollout server(s) %s have no /weights swap: the trainer pauses each backend itself (in-flight "
                    "turns are aborted and re-sent)", [s for s, f in zip(self.rollout.urls, flags) if not f])
        return "legacy"

    async def _push(self, path: Path, digest: str, version: int, previous: int) -> PushReport:
        async with aiohttp.ClientSession() as session:
            if self.protocol == "legacy":
                return await push_weights(session, str(path), version, self.backends, self.rollout.urls,
                                          sha256=digest, headers=self.rollout.headers, pause=self.pause,
                                          timeout_s=self.timeout_s)
            return await swap_weights(session, str(path), version, self.backends, self.rollout.urls, digest=digest,
                                      headers=self.rollout.headers, kv=self.kv, max_staleness=self.staleness_bound,
                                      lease_s=self.lease_s, previous_version=previous, timeout_s=self.timeout_s)

    # ------------------------------------------------------------------ rank 0 and the others
    @staticmethod
    def _share(outcome: Optional[str], main: bool) -> Optional[str]:
        """Every rank waits here for the main process's outcome (None: pushed; else the error message)."""
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover
            return outcome
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return outcome
        box = [outcome if main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def push(self, model: Any, version: int, args: Any, main: bool) -> Optional[PushReport]:
        """Gather (every rank), write and push (the main process only), then wait for every rank. Returns the
        main process's report (None on the other ranks, and after a warned failure).

        Raises:
            WeightPushError, SwapRefusedError (on every rank; ``on_error="raise"``): the push failed.
        """
        t0 = time.monotonic()
        sd = gather_full_state_dict(model)  # a collective under FSDP / ZeRO-3: every rank takes part
        gather_s = time.monotonic() - t0
        report: Optional[PushReport] = None
        outcome: Optional[str] = None
        error: Optional[BaseException] = None
        if main:
            previous = int(self.rollout.weight_version)
            path = self._dir(args) / f"step-{version:06d}.safetensors"
            t1 = time.monotonic()
            digest = save_weights(model, path, state_dict=sd, metadata={"prorl_version": version})
            save_s = time.monotonic() - t1
            in_flight = self.rollout.jobs_in_flight() if hasattr(self.rollout, "jobs_in_flight") else None
            servers = list(self.rollout.urls)  # the members this push reaches (a fleet's joiners: the registrar)
            try:
                report = self.rollout.run_async(self._push(path, digest, version, previous))
            except (WeightPushError, SwapRefusedError) as e:
                error = e
                failed = getattr(e, "failed", {}) or {"*": str(e)}
                report = PushReport(version=version, path=str(path), pushed=list(getattr(e, "pushed", [])),
                                    failed=dict(failed), mode=self.protocol)
            report.gather_s, report.save_s, report.jobs_in_flight = gather_s, save_s, in_flight
            report.bytes = path.stat().st_size
            report.total_s = time.monotonic() - t0
            self.reports.append(report)
            if error is None:
                self.rollout.weight_version = version
                if hasattr(self.rollout, "cancel_stale"):
                    self.rollout.cancel_stale()  # prefetched groups the new version leaves past the bound
                if isinstance(self.rollout.urls, Fleet) and not isinstance(self.backends, Mapping):
                    self.rollout.run_async(self._followed(version, servers))  # joiners get these backends
                self._files.append(path)
                while len(self._files) > self.keep:
                    old = self._files.pop(0)
                    try:
                        old.unlink()
                    except FileNotFoundError:
                        pass
                log.info("weights v%d pushed to %d backend(s) in %.2f s (%s: gather %.2f s, save %.2f s, pause "
                         "%.2f s, load %.2f s, resume %.2f s; %.1f s/GB; %s jobs in flight)", version,
                         len(report.pushed), report.total_s, report.mode, report.gather_s, report.save_s,
                         report.pause_s, report.load_s, report.resume_s or report.register_s,
                         report.s_per_gb or 0.0, in_flight)
            elif self.on_error == "raise":
                outcome = f"{type(error).__name__}: {error}"
            else:
                log.warning("%s", error)
        del sd
        outcome = self._share(outcome, main)
        if outcome is not None:
            if error is not None:
                raise error
            raise WeightPushError(f"the main process's weight push failed: {outcome}", {}, [], version)
        return report if main else None

    # ------------------------------------------------------------------ TrainerCallback hooks
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Label the backends with the weights they serve: version 0 for a fresh run; a run resumed from a
        checkpoint (``global_step > 0``) pushes the checkpoint's weights first, then labels them with its step."""
        version = int(state.global_step or 0)
        main = bool(getattr(state, "is_world_process_zero", True))
        if main:
            self.protocol = self.rollout.run_async(self._resolve_protocol())
        if version > 0:
            if model is None:
                raise RuntimeError("WeightPushCallback.on_train_begin got no model to push for a resumed run")
            # The vLLM servers serve the weights they were started with, not the checkpoint's.
            self.push(model, version, args, main)
            log.info("resumed at step %d: pushed the checkpoint's weights as version %d", version, version)
            return control
        if main:
            self.rollout.run_async(self._register(version))
            self.rollout.weight_version = version
            log.info("registered %d vLLM backend(s) with weight version %d (%s protocol)", len(self._all_backends()),
                     version, self.protocol)
        self._share(None, main)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        """Training is over: the prefetched batches can no longer be trained; their jobs are cancelled on the
        servers (sandboxes and LLM calls released) and counted in the rollout's ``stale_cancelled``."""
        if hasattr(self.rollout, "cancel_pending"):
            self.rollout.cancel_pending("training ended")
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        """After an optimizer step: gather, save, swap (version = ``state.global_step``)."""
        if model is None:
            raise RuntimeError("WeightPushCallback.on_step_end got no model")
        self.push(model, int(state.global_step), args, bool(getattr(state, "is_world_process_zero", True)))
        return control
