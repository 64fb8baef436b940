"""The ``swe`` handler: repository tasks in the style of SWE-Gym / R2E-Gym (Jimenez et al. 2024,
"SWE-bench"; Pan et al. 2024, "SWE-Gym").

Instance::

    {"data_source": "swe", "instance_id": str, "problem_statement": str,
     "repo": "/host/path/of/a/git/repo"        # bubblewrap/local: bound read-only and copied, or
     "repo_path": "/testbed",                  # the repository's path inside ``image`` (Singularity .sif)
     "image": null | "/path/rootfs" | "x.sif", # null = the host root (bubblewrap)
     "test_command": "python -m pytest -rA -p no:cacheprovider",   # optional; must print -rA lines
     "test_files": {"tests/test_hidden.py": "..."},                # optional hidden tests written at eval
     "FAIL_TO_PASS": ["tests/test_x.py::test_bug"], "PASS_TO_PASS": ["tests/test_x.py::test_ok"]}

- init: a sandbox (no network) with a private, writable copy of the repository at ``<workdir>/repo``.
- run: the agent loop with ``bash`` and ``str_replace_editor``; then the patch is taken with
  ``git add -A && git diff --cached --binary`` against the starting commit.
- eval: a FRESH sandbox and a fresh copy; ``git apply`` the patch, write the hidden test files, run the test
  command, parse pytest's ``-rA`` summary. Reward 1.0 when every FAIL_TO_PASS and PASS_TO_PASS test passed,
  else 0.0; ``extra["eval"]`` has each test's status, whether the patch applied, and the output tail.
"""
from __future__ import annotations

import re
import shlex
from typing import Any

from handlers.base import AgentHandler
from handlers.tools import run_agent, sandbox_tools

REPO_SRC = "/repo_src"
DEFAULT_TEST_COMMAND = "python -m pytest -rA -p no:cacheprovider"
PATCH_FILE = "prorl_patch.diff"
SYSTEM_PROMPT = ("You are a software engineer fixing an issue in a git repository. Inspect the code, make the "
                 "smallest correct change, optionally run the tests, then call finish.")
_STATUS = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+)")


def parse_pytest_report(output: str) -> dict[str, str]:
    """Test node id -> status from pytest's ``-rA`` short summary lines (``PASSED tests/t.py::test_a``).
    A ``FAILED node - message`` line keeps only the node id."""
    status: dict[str, str] = {}
    for line in output.splitlines():
        m = _STATUS.match(line.strip())
        if m:
            status[m.group(2)] = m.group(1)
    return status


def _spec(instance: dict[str, Any]) -> Any:
    from sandbox import Limits, SandboxSpec

    binds = [(instance["repo"], REPO_SRC, True)] if instance.get("repo") else []
    return SandboxSpec(image=instance.get("image"), binds=binds, network="none",
                       limits=Limits(max_processes=512, max_memory_bytes=8 << 30))


async def _checkout(handle, instance: dict[str, Any]) -> str:
    """Copy the repository into the workspace; returns the starting commit. Raises RuntimeError on failure."""
    src = REPO_SRC if instance.get("repo") else instance["repo_path"]
    r = await handle.bash(f"mkdir -p ~/repo && cp -a {shlex.quote(src)}/. ~/repo/ 2>&1 && "
                          "git -C ~/repo rev-parse HEAD", timeout_s=300)
    if r.exit_code != 0:
        raise RuntimeError(f"could not copy the repository from {src}: {r.output[-1000:]}")
    return r.output.strip().splitlines()[-1]


class SweHandler(AgentHandler):
    """See the module docstring for the instance format; optional ``max_turns`` (default 20) and
    ``eval_timeout_s`` (default 600)."""

    name = "swe"
    aliases = ("swe_gym", "r2e_gym")
    needs_llm = True

    async def init(self, job) -> None:
        inst = job.instance
        if not inst.get("repo") and not inst.get("repo_path"):
            raise ValueError("swe instance needs 'repo' (host path) or 'repo_path' (path inside the image)")
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            if not isinstance(inst.get(key, []), list):
                raise ValueError(f"swe instance field {key} must be a list of test ids")
        handle = await job.open_sandbox(_spec(inst))
        job.state["base_commit"] = await _checkout(handle, inst)
        job.state["sandbox"] = handle

    async def run(self, job) -> None:
        from prorl_server.agent_loop import AgentConfig

        handle = job.state["sandbox"]
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": "The repository is in ./repo (bash starts in its parent "
                     f"directory). Fix this issue:\n\n{job.instance.get('problem_statement', '')}"}]
        try:
            await run_agent(job, messages, sandbox_tools(handle, ("bash", "str_replace_editor")),
                            AgentConfig(max_turns=int(job.instance.get("max_turns", 20))))
        finally:
            job.state["patch"] = await self._take_patch(handle, job.state["base_commit"])

    @staticmethod
    async def _take_patch(handle, base: str) -> str:
        # cd ~ (the workspace in every runtime): the agent may have left the shell anywhere.
        # Byte-code caches from the agent's own test runs are not part of a fix.
        r = await handle.bash(f"cd ~/repo && git add -A -- . ':(exclude,glob)**/__pycache__/**' "
                              f"':(exclude,glob)**/*.pyc' && "
                              f"git diff --cached --binary {base} > ../{PATCH_FILE}; s=$?; cd ..; exit $s",
                              timeout_s=120)
        if r.exit_code != 0:
            raise RuntimeError(f"could not take the patch: {r.output[-1000:]}")
        return (await handle.download(PATCH_FILE)).decode("utf-8", errors="surrogateescape")

    async def eval(self, job) -> None:
        inst = job.instance
        patch = job.state.get("patch", "")
        handle = await job.open_sandbox(_spec(inst))
        info: dict[str, Any] = {"patch_bytes": len(patch.encode("utf-8", "surrogateescape"))}
        await _checkout(handle, inst)
        if patch.strip():
            await handle.upload(PATCH_FILE, patch.encode("utf-8", "surrogateescape"))
            r = await handle.bash(f"cd ~/repo && git apply --whitespace=nowarn ../{PATCH_FILE}", timeout_s=120)
            info["patch_applied"] = r.exit_code == 0
            if r.exit_code != 0:
                info["apply_error"] = r.output[-2000:]
                job.reward, job.resolved, job.extra["eval"] = 0.0, False, info
                return
        else:
            info["patch_applied"] = False
        for path, text in (inst.get("test_files") or {}).items():
            await handle.upload(f"repo/{path}", text.encode())
        cmd = inst.get("test_command") or DEFAULT_TEST_COMMAND
        r = await handle.bash(f"cd ~/repo && {cmd}", timeout_s=float(inst.get("eval_timeout_s", 600)))
        status = parse_pytest_report(r.output)
        f2p = {t: status.get(t, "MISSING") for t in inst.get("FAIL_TO_PASS", [])}
        p2p = {t: status.get(t, "MISSING") for t in inst.get("PASS_TO_PASS", [])}
        info.update(FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, timed_out=r.timed_out, test_exit_code=r.exit_code,
                    output_tail=r.output[-3000:])
        tests = {**f2p, **p2p}
        job.resolved = bool(tests) and all(s == "PASSED" for s in tests.values())
        job.reward = 1.0 if job.resolved else 0.0
        job.extra["eval"] = info
