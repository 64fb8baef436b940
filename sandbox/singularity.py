"""Singularity / Apptainer runtime: ``<apptainer|singularity> exec --containall ...`` of a ``.sif`` image.

The binary is whichever of ``apptainer`` and ``singularity`` is on PATH (apptainer first); spython only looks
for ``singularity``, so it is not used here. The whole command line comes from :func:`build_singularity_command`
(checked exactly by the unit tests).

Isolation: ``--containall`` gives fresh /tmp, /dev, IPC and PID namespaces and no home mount; ``--no-home``
says so explicitly; ``--no-mount hostfs,bind-paths,cwd`` drops what a site's ``apptainer.conf`` adds for every
container (``mount hostfs``, its ``bind path`` entries, which are often writable scratch or home trees, and the
current directory); ``--cleanenv`` keeps the host environment out; ``network="none"`` adds
``--net --network none``. Sites may forbid some of these (network namespaces, fakeroot, user namespaces): on its
first start with a given image and set of isolation flags the runtime runs one cheap ``exec`` with exactly those
flags (:meth:`SingularityRuntime.probe`) and, if it fails, tries again without each flag in turn to name the one
the site refuses, and raises :class:`~sandbox.errors.SandboxStartError` saying so (never a silent downgrade).

Interpreter: an image built by ``prorl-build-image`` carries its own venv with this project installed and
exports ``PRORL_EXEC_PYTHON`` (its python) in its environment; the probe reads it, and the execution server
then runs with that python and the image's own copy of the project, nothing of the host's interpreter bound.
Any other image gets the host interpreter's Python view (:mod:`sandbox.python_view`: standard library, the
allowed distributions only, the project's ``sandbox`` package, under ``/prorl``) bound read-only, the same
binds as bubblewrap's (the image then needs a compatible C library).

Bounds (:mod:`sandbox.bounds`): the memory cgroup and the workspace's disk quota are the runtime's, as for
bubblewrap. The size of ``/tmp`` under ``--containall`` is the site's (``sessiondir max size`` in
``apptainer.conf``), not set per sandbox.
"""
from __future__ import annotations

import asyncio
import os
import shutil
from typing import Optional, Union

from .errors import SandboxError, SandboxStartError
from .runtime import CONFIG_NAME, SOCKET_NAME, LaunchContext, SandboxRuntime, server_binds
from .spec import SandboxSpec

#: What ``--no-mount`` disables (Apptainer >= 1.0 / SingularityCE >= 3.7 values): the site's host file system
#: mounts, its configured bind paths and the current working directory.
NO_MOUNT = "hostfs,bind-paths,cwd"
#: Variable an image built by ``prorl-build-image`` sets to the python of its own venv.
EXEC_PYTHON_VAR = "PRORL_EXEC_PYTHON"
PROBE_MARK = "prorl-probe:"


def find_singularity() -> Optional[str]:
    """Path of ``apptainer`` or else ``singularity`` on PATH, or ``None``."""
    return shutil.which("apptainer") or shutil.which("singularity")


def isolation_flags(spec: SandboxSpec) -> list[list[str]]:
    """The isolation options for ``spec``, grouped as they are named in errors (each group one feature)."""
    groups = [["--containall"], ["--no-home"], ["--no-mount", NO_MOUNT], ["--cleanenv"]]
    if spec.fakeroot:
        groups.append(["--fakeroot"])
    if spec.writable_tmpfs:
        groups.append(["--writable-tmpfs"])
    if spec.network == "none":
        groups.append(["--net", "--network", "none"])
    return groups


def build_singularity_command(binary: str, spec: SandboxSpec, ctx: LaunchContext,
                              ro_paths: Optional[list[Union[str, tuple[str, str]]]] = None,
                              exec_python: Optional[str] = None) -> list[str]:
    """The complete argv. ``exec_python``: the image's own interpreter with this project installed (from
    ``PRORL_EXEC_PYTHON``); then nothing of the host's interpreter is bound. Otherwise ``ro_paths``: what is
    bound read-only for the execution server, each a ``(host, container)`` pair or a host path bound at the
    same place; ``None`` = the Python view's binds (:func:`sandbox.runtime.server_binds`), whose variables
    (``LD_LIBRARY_PATH``) are passed with ``--env`` like ``PYTHONPATH``. Raises :class:`SandboxError` for a
    spec without an image."""
    if not spec.image:
        raise SandboxError("singularity runtime needs spec.image (a .sif file or sandbox directory)")
    args = [binary, "exec", "--containall", "--no-home", "--no-mount", NO_MOUNT, "--cleanenv", "--pwd", spec.workdir]
    if spec.fakeroot:
        args.append("--fakeroot")
    if spec.writable_tmpfs:
        args.append("--writable-tmpfs")
    if spec.network == "none":
        args += ["--net", "--network", "none"]
    if exec_python is None:
        for p in (server_binds(ctx) if ro_paths is None else ro_paths):
            host, container = (p, p) if isinstance(p, str) else p
            args += ["--bind", f"{host}:{container}:ro"]
    for b in spec.binds:
        args += ["--bind", f"{b.host}:{b.container}:{'ro' if b.ro else 'rw'}"]
    args += ["--bind", f"{ctx.run_dir}:{ctx.sandbox_run_dir}:rw",
             "--bind", f"{ctx.workspace}:{ctx.sandbox_workspace}:rw"]
    if exec_python is None:
        env = [f"{k}={v}" for k, v in (ctx.view.env if ctx.view is not None else ())]
        return (args + ["--env", f"PYTHONPATH={':'.join(ctx.pythonpath)}"]
                + [a for e in env for a in ("--env", e)] + [spec.image] + ctx.server_argv())
    # The image's venv finds its own site-packages (no -S, no PYTHONPATH). -I: `-m` would put the current
    # directory (the workspace, --pwd) first on sys.path, so a task repository's own `sandbox/`, `select.py` or
    # `socket.py` would replace the server's modules (or fail every start).
    return args + [spec.image, exec_python, "-I", "-m", "sandbox.exec_server",
                   "--socket", os.path.join(ctx.sandbox_run_dir, SOCKET_NAME),
                   "--config", os.path.join(ctx.sandbox_run_dir, CONFIG_NAME)]


def build_probe_command(binary: str, spec: SandboxSpec, drop: Optional[list[str]] = None) -> list[str]:
    """``<binary> exec <isolation flags> <image> /bin/sh -c ...``: prints ``prorl-probe:<PRORL_EXEC_PYTHON>``
    (empty when the image has no venv of its own or it is not executable). ``drop``: one isolation group left
    out (to find which one the site refuses)."""
    flags = [f for g in isolation_flags(spec) if g != drop for f in g]
    script = f'p="${{{EXEC_PYTHON_VAR}:-}}"; [ -n "$p" ] && [ -x "$p" ] || p=; echo "{PROBE_MARK}$p"'
    return [binary, "exec", *flags, spec.image, "/bin/sh", "-c", script]


class SingularityRuntime(SandboxRuntime):
    """Options (besides :class:`SandboxRuntime`'s): ``binary`` (default: :func:`find_singularity`);
    ``probe_timeout_s`` (seconds one probe ``exec`` may take, default 120: a first run may unpack a SIF)."""

    kind = "singularity"

    def __init__(self, *, binary: Optional[str] = None, probe_timeout_s: float = 120.0, **options) -> None:
        self.binary = binary or find_singularity()
        if not self.binary:
            raise SandboxError("singularity runtime: neither `apptainer` nor `singularity` is on PATH")
        super().__init__(**options)
        self.probe_timeout_s = probe_timeout_s
        # (image, isolation flags) -> the image's exec python ("" = none); one probe each, shared by
        # concurrent starts.
        self._probes: dict[tuple, asyncio.Future] = {}
        self._exec_python: dict[str, str] = {}

    async def _run(self, argv: list[str]) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.probe_timeout_s)
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        return proc.returncode, out.decode("utf-8", errors="replace")

    async def probe(self, spec: SandboxSpec) -> str:
        """Check once per (image, isolation flags) that this site lets ``spec``'s isolation run; returns the
        image's own execution-server python (``""`` if it has none). Raises :class:`SandboxStartError` naming
        the refused flag (found by leaving out one isolation group at a time), or with the probe's output if no
        single flag explains the failure; ``asyncio.TimeoutError`` is reported the same way."""
        key = (spec.image, tuple(f for g in isolation_flags(spec) for f in g))
        fut = self._probes.get(key)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = self._probes[key] = asyncio.ensure_future(self._probe(spec))
        return await asyncio.shield(fut)

    async def _probe(self, spec: SandboxSpec) -> str:
        argv = build_probe_command(self.binary, spec)
        try:
            rc, out = await self._run(argv)
        except asyncio.TimeoutError:
            raise SandboxStartError(f"{self.binary} probe did not finish within {self.probe_timeout_s:g} s: "
                                    f"{' '.join(argv)}") from None
        for line in out.splitlines():
            if rc == 0 and line.startswith(PROBE_MARK):
                return line[len(PROBE_MARK):].strip()
        tail = out.strip()[-2000:]
        for group in isolation_flags(spec):
            if group == ["--containall"] or group == ["--cleanenv"] or group == ["--no-home"]:
                continue  # not a site capability: leaving these out proves nothing about the site
            rc2, out2 = await self._run(build_probe_command(self.binary, spec, drop=group))
            if rc2 == 0 and PROBE_MARK in out2:
                hint = {"--net": "network namespaces are disabled here; use network=\"host\" or \"loopback\" "
                                 "(no isolation of the network) only if that is acceptable, or ask the site to "
                                 "allow `--net --network none`",
                        "--fakeroot": "fakeroot (user namespace with subuid mapping) is not allowed here; "
                                      "use fakeroot=False",
                        "--writable-tmpfs": "writable tmpfs overlays are not allowed here; use "
                                            "writable_tmpfs=False",
                        "--no-mount": "this apptainer/singularity does not know `--no-mount` (needs "
                                      "Apptainer >= 1.0 or SingularityCE >= 3.7)"}.get(group[0], "")
                raise SandboxStartError(f"{self.binary} refuses the isolation flag `{' '.join(group)}` on this "
                                        f"site (the same exec without it works): {hint}\nprobe output:\n{tail}")
        raise SandboxStartError(f"{self.binary} cannot run image {spec.image} with the sandbox's isolation "
                                f"({' '.join(argv[2:-4])}); probe exit status {rc}:\n{tail}")

    async def prepare_launch(self, spec: SandboxSpec) -> None:
        if not spec.image:
            raise SandboxError("singularity runtime needs spec.image (a .sif file or sandbox directory)")
        self._exec_python[spec.image] = await self.probe(spec)

    def uses_python_view(self, spec: SandboxSpec) -> bool:
        return not self._exec_python.get(spec.image or "")

    def build_command(self, spec: SandboxSpec, ctx: LaunchContext) -> list[str]:
        return build_singularity_command(self.binary, spec, ctx,
                                         exec_python=self._exec_python.get(spec.image or "") or None)
