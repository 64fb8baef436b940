"""Singularity / Apptainer runtime: ``<apptainer|singularity> exec --containall ...`` of a ``.sif`` image.

The binary is whichever of ``apptainer`` and ``singularity`` is on PATH (apptainer first); spython only looks
for ``singularity``, so it is not used here. The whole command line comes from :func:`build_singularity_command`
(checked exactly by the unit tests). ``--containall`` gives fresh /tmp, /dev, IPC and PID namespaces and no
home mount; ``--no-home`` says so explicitly; ``--cleanenv`` keeps the host environment out. The execution
server runs with the host's interpreter and project bound read-only at their host paths (the image needs a
compatible C library).
"""
from __future__ import annotations

import shutil
from typing import Optional

from .bubblewrap import _needed_paths
from .errors import SandboxError
from .runtime import LaunchContext, SandboxRuntime
from .spec import SandboxSpec


def find_singularity() -> Optional[str]:
    """Path of ``apptainer`` or else ``singularity`` on PATH, or ``None``."""
    return shutil.which("apptainer") or shutil.which("singularity")


def build_singularity_command(binary: str, spec: SandboxSpec, ctx: LaunchContext,
                              ro_paths: Optional[list[str]] = None) -> list[str]:
    """The complete argv. ``ro_paths``: host paths bound read-only at the same place (the interpreter and
    the project); ``None`` = computed from this interpreter."""
    if not spec.image:
        raise SandboxError("singularity runtime needs spec.image (a .sif file or sandbox directory)")
    args = [binary, "exec", "--containall", "--no-home", "--cleanenv", "--pwd", spec.workdir]
    if spec.fakeroot:
        args.append("--fakeroot")
    if spec.writable_tmpfs:
        args.append("--writable-tmpfs")
    if spec.network == "none":
        args += ["--net", "--network", "none"]
    for p in (_needed_paths(ctx) if ro_paths is None else ro_paths):
        args += ["--bind", f"{p}:{p}:ro"]
    for b in spec.binds:
        args += ["--bind", f"{b.host}:{b.container}:{'ro' if b.ro else 'rw'}"]
    args += ["--bind", f"{ctx.run_dir}:{ctx.sandbox_run_dir}:rw",
             "--bind", f"{ctx.workspace}:{ctx.sandbox_workspace}:rw",
             "--env", f"PYTHONPATH={':'.join(ctx.pythonpath)}", spec.image]
    return args + ctx.server_argv()


class SingularityRuntime(SandboxRuntime):
    """Options (besides :class:`SandboxRuntime`'s): ``binary`` (default: :func:`find_singularity`)."""

    kind = "singularity"

    def __init__(self, *, binary: Optional[str] = None, **options) -> None:
        self.binary = binary or find_singularity()
        if not self.binary:
            raise SandboxError("singularity runtime: neither `apptainer` nor `singularity` is on PATH")
        super().__init__(**options)

    def build_command(self, spec: SandboxSpec, ctx: LaunchContext) -> list[str]:
        return build_singularity_command(self.binary, spec, ctx)
