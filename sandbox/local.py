"""Local runtime: NO ISOLATION. The execution server and every command run directly on the host as the server's
user, with the host's file system and network. For development only; every start logs a warning.

Cleanup still holds: the server runs in its own session and process group, the shell and the kernel lead
their own sessions, recorded in the run directory, so close and crash-reaping kill exactly those processes.
``spec.image``, ``workdir``, ``binds``, ``network="none"`` and ``fakeroot`` cannot be honoured and are ignored
(with a warning); the workspace is a host directory and the tools see its host path.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from .runtime import SESSIONS_NAME, LaunchContext, SandboxRuntime
from .spec import SandboxSpec

log = logging.getLogger(__name__)


class LocalRuntime(SandboxRuntime):
    """No-isolation runtime (kind ``"local"``; sandbox ids start with ``unisolated-``)."""

    kind = "local"
    isolated = False

    def __init__(self, **options) -> None:
        super().__init__(**options)
        log.warning("LocalRuntime: sandboxes are NOT isolated; agent commands run on this host as uid %d",
                    os.getuid())

    @property
    def id_prefix(self) -> str:
        return "unisolated"

    def sandbox_paths(self, spec: SandboxSpec, run_dir: str, workspace: str) -> tuple[str, str]:
        return workspace, run_dir  # no mount namespace: the tools see host paths

    def sessions_file(self, ctx: LaunchContext) -> Optional[str]:
        return os.path.join(ctx.run_dir, SESSIONS_NAME)

    def build_command(self, spec: SandboxSpec, ctx: LaunchContext) -> list[str]:
        ignored = [n for n, bad in (("image", spec.image), ("binds", spec.binds), ("fakeroot", spec.fakeroot),
                                    ("network=none", spec.network == "none")) if bad]
        log.warning("local sandbox %s is NOT isolated (workspace %s)%s", ctx.sandbox_id, ctx.workspace,
                    f"; ignored: {', '.join(ignored)}" if ignored else "")
        return ctx.server_argv()
