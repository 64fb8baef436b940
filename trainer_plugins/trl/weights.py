"""Push a trainer's new weights into the rollout servers' vLLM backends and re-register them with the new
weight version.

:class:`WeightPushCallback` is a ``transformers.TrainerCallback``: after every optimizer step (``on_step_end``)
it writes the model's weights to one safetensors file and calls :func:`push_weights`, which, for each vLLM
backend (started with ``--worker-extension-cls trainer_plugins.vllm_weights.WeightLoaderExtension`` and
``VLLM_SERVER_DEV_MODE=1``):

1. ``POST /pause`` (in-flight turns are aborted; the rollout server's LLM client re-sends them after the
   update) ;
2. ``POST /collective_rpc {"method": "prorl_load_weights", "args": [path, sha256]}`` (the worker extension
   loads the file and rebuilds the CPU kernels' packed weights) ;
3. ``POST /reset_prefix_cache`` (cached KV was computed with the old weights) and ``POST /resume``;

then re-registers every backend that loaded them with every rollout server (``POST /add_llm_server
{address, weight_version}``: a known address is the same backend with a new version), version =
the trainer's ``global_step``. At ``on_train_begin`` the backends are registered with the current step (0 for
a fresh run), so the first batch's trajectories carry a version too.

Failure: a backend whose push fails (unreachable, no worker extension, a file it cannot read, a checksum
mismatch) is *not* re-registered: it keeps the version it had, which stays true when its load failed before
writing anything (missing file, wrong checksum, unknown tensor names are all refused first). The backends that
did load are registered with the new version, and :class:`WeightPushError` says which backend failed and why
(vLLM's own answer); by default it stops training (``on_error="raise"``), ``on_error="warn"`` logs it and goes
on (the failed backend then serves old weights under its old version: its rows are off-policy and say so).

Sources: vLLM's development endpoints (``vllm/entrypoints/serve/dev``: ``/pause``, ``/resume``,
``/reset_prefix_cache``, ``/collective_rpc``); ProRL Agent paper, section 3.3 (re-registration after each
update).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import aiohttp

from trainer_plugins.client import register_backends

log = logging.getLogger(__name__)

RPC_METHOD = "prorl_load_weights"


class WeightPushError(RuntimeError):
    """At least one backend did not load the new weights. ``failed``: ``{backend: reason}``; ``pushed``:
    backends that did (registered with ``version``); ``version``: the version that was pushed."""

    def __init__(self, message: str, failed: Mapping[str, str], pushed: Sequence[str], version: int) -> None:
        super().__init__(message)
        self.failed = dict(failed)
        self.pushed = list(pushed)
        self.version = version


@dataclass
class PushReport:
    """One push: ``version``, ``path`` of the weights file, ``pushed`` backends, ``failed`` ``{backend:
    reason}``, ``save_s`` (writing the file), ``load_s`` (pause -> load -> resume, slowest backend),
    ``register_s``, ``total_s`` (seconds)."""

    version: int
    path: str
    pushed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    save_s: float = 0.0
    load_s: float = 0.0
    register_s: float = 0.0
    total_s: float = 0.0


def save_weights(model: Any, path: Union[str, os.PathLike]) -> str:
    """Write ``model``'s parameters and persistent buffers (Hugging Face names) to a safetensors file,
    atomically (written beside it, then renamed: a reader never sees half a file). Tied tensors are written
    once (``safetensors.torch.save_model``). Returns the file's SHA-256 (hex)."""
    from safetensors.torch import save_model

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_model(model, str(tmp))
    h = hashlib.sha256()
    with open(tmp, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    os.replace(tmp, path)
    return h.hexdigest()


async def _post(session: aiohttp.ClientSession, url: str, timeout_s: float, **kwargs: Any) -> Any:
    async with session.post(url, timeout=aiohttp.ClientTimeout(total=timeout_s), **kwargs) as r:
        text = await r.text()
        if r.status != 200:
            raise RuntimeError(f"POST {url} answered HTTP {r.status}: {text[:1000]}")
        return text


async def load_into_backend(session: aiohttp.ClientSession, backend: str, path: str, sha256: str = "", *,
                            pause: bool = True, timeout_s: float = 300.0) -> None:
    """Steps 1-3 of the module docstring for one vLLM backend.

    Raises:
        RuntimeError: a step failed; the message has vLLM's answer (generation is resumed in every case).
    """
    if pause:
        await _post(session, f"{backend}/pause", timeout_s)
    try:
        text = await _post(session, f"{backend}/collective_rpc", timeout_s,
                           json={"method": RPC_METHOD, "args": [str(path), sha256], "timeout": timeout_s})
        results = (json.loads(text) or {}).get("results") if text else None
        if not isinstance(results, list) or not results:
            raise RuntimeError(f"{backend}/collective_rpc {RPC_METHOD} gave no result ({text[:300]!r}): is vLLM "
                               f"started with --worker-extension-cls trainer_plugins.vllm_weights."
                               f"WeightLoaderExtension?")
        failed = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
        if failed:
            why = failed[0].get("error") if isinstance(failed[0], dict) else failed[0]
            raise RuntimeError(f"{backend} did not load {path}: {why}")
        await _post(session, f"{backend}/reset_prefix_cache", timeout_s)
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


async def push_weights(session: aiohttp.ClientSession, path: str, version: int,
                       backends: Union[Sequence[str], Mapping[str, Sequence[str]]], servers: Sequence[str], *,
                       sha256: str = "", headers: Optional[Mapping[str, str]] = None, pause: bool = True,
                       timeout_s: float = 300.0) -> PushReport:
    """Load ``path`` into every backend and re-register those that loaded it with every rollout server under
    ``weight_version=version`` (see the module docstring).

    Args:
        backends: vLLM base URLs (registered with every server), or ``{server_url: [backend, ...]}``.
        servers: rollout server URLs. headers: for the rollout servers (bearer token).

    Raises:
        WeightPushError: a backend failed (the others are registered with ``version``; the failed ones keep
            their version). RuntimeError: a rollout server refused the registration.
    """
    t0 = time.monotonic()
    per_server = ({s: list(backends.get(s, ())) for s in servers} if isinstance(backends, Mapping)
                  else {s: list(backends) for s in servers})
    unique = list(dict.fromkeys(b for bs in per_server.values() for b in bs))
    report = PushReport(version=version, path=str(path))
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
    report.total_s = time.monotonic() - t0
    if report.failed:
        why = "; ".join(f"{b}: {r}" for b, r in report.failed.items())
        raise WeightPushError(f"weights v{version} ({path}) were not loaded by {len(report.failed)} of "
                              f"{len(unique)} backend(s), which stay registered with their previous version: {why}",
                              report.failed, report.pushed, version)
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
        pause: pause generation on each backend around the load.
        timeout_s: per HTTP call, seconds.

    ``reports`` lists a :class:`PushReport` per push.
    """

    def __init__(self, rollout: Any, backends: Union[None, Sequence[str], Mapping[str, Sequence[str]]] = None, *,
                 weights_dir: Optional[Union[str, os.PathLike]] = None, keep: int = 2, on_error: str = "raise",
                 pause: bool = True, timeout_s: float = 300.0) -> None:
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
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
        self.pause = pause
        self.timeout_s = timeout_s
        self.reports: list[PushReport] = []
        self._files: list[Path] = []

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
        async with aiohttp.ClientSession() as session:
            for server in self.rollout.urls:
                bs = self.backends.get(server, ()) if isinstance(self.backends, Mapping) else self.backends
                if bs:
                    await register_backends(session, server, list(bs), version, clear=False,
                                            headers=self.rollout.headers)

    async def _push(self, path: Path, sha: str, version: int) -> PushReport:
        async with aiohttp.ClientSession() as session:
            return await push_weights(session, str(path), version, self.backends, self.rollout.urls, sha256=sha,
                                      headers=self.rollout.headers, pause=self.pause, timeout_s=self.timeout_s)

    # ------------------------------------------------------------------ TrainerCallback hooks
    def on_train_begin(self, args, state, control, **kwargs):
        """Register the backends with the trainer's current step: the weights they serve now."""
        version = int(state.global_step or 0)
        self.rollout.run_async(self._register(version))
        self.rollout.weight_version = version
        log.info("registered %d vLLM backend(s) with weight version %d", len(self._all_backends()), version)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        """After an optimizer step: save, push, re-register (version = ``state.global_step``)."""
        if model is None:
            raise RuntimeError("WeightPushCallback.on_step_end got no model")
        version = int(state.global_step)
        t0 = time.monotonic()
        path = self._dir(args) / f"step-{version:06d}.safetensors"
        sha = save_weights(_unwrap(model), path)
        save_s = time.monotonic() - t0
        try:
            report = self.rollout.run_async(self._push(path, sha, version))
        except WeightPushError as e:
            self.reports.append(PushReport(version=version, path=str(path), pushed=e.pushed, failed=e.failed,
                                           save_s=save_s, total_s=time.monotonic() - t0))
            if self.on_error == "raise":
                raise
            log.warning("%s", e)
            return control
        report.save_s = save_s
        report.total_s = time.monotonic() - t0
        self.reports.append(report)
        self.rollout.weight_version = version
        self._files.append(path)
        while len(self._files) > self.keep:
            old = self._files.pop(0)
            try:
                old.unlink()
            except FileNotFoundError:
                pass
        log.info("weights v%d pushed to %d backend(s) in %.2f s (save %.2f s, load %.2f s, register %.2f s)",
                 version, len(report.pushed), report.total_s, report.save_s, report.load_s, report.register_s)
        return control


def _unwrap(model: Any) -> Any:
    """The plain model under accelerate / DDP wrappers (``module``); PEFT models are not merged here."""
    import torch

    while isinstance(getattr(model, "module", None), torch.nn.Module) and model.module is not model:
        model = model.module
    return model
