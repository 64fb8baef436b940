"""The ``swe`` handler: repository tasks in the style of SWE-Gym / R2E-Gym (Jimenez et al. 2024,
"SWE-bench"; Pan et al. 2024, "SWE-Gym").

Instance::

    {"data_source": "swe", "instance_id": str, "problem_statement": str,
     "repo": "/host/path/of/a/git/repo"        # bubblewrap/local: bound read-only and copied, or
     "repo_path": "/testbed",                  # the repository's path inside ``image`` (Singularity .sif)
     "image": null | "/path/rootfs" | "x.sif", # null = the host root (bubblewrap)
     "test_command": "python -m pytest",       # optional; a pytest invocation, the handler adds the rest
     "test_files": {"tests/test_hidden.py": "..."},                # optional hidden tests written at eval
     "test_patch": "diff --git ...",                               # optional, SWE-bench's test patch
     "FAIL_TO_PASS": ["tests/test_x.py::test_bug"], "PASS_TO_PASS": ["tests/test_x.py::test_ok"]}

- init: a sandbox (no network) with a private, writable copy of the repository at ``<workdir>/repo``.
- run: the agent loop with ``bash`` and ``str_replace_editor``; then the patch is taken with
  ``git add -A && git diff --cached --binary`` against the starting commit.
- eval: first the patch is checked on the host as plain text (:mod:`handlers.swe.patch_check`): a patch
  that reaches for the test machinery (conftest, pytest configuration or internals, hooks, atexit, writes to
  ``sys.modules``/``builtins``, the report's name...) scores 0.0 with ``extra["eval"]["flagged"]`` saying
  why, and its tests are not run. Otherwise, on a clean test harness: a FRESH sandbox and a fresh copy; ``git
  apply`` the patch; every
  path it touched that decides how tests run (see :mod:`handlers.swe.harness`: tests, conftest and
  configuration files, import hooks, files added outside a package) is restored from the base commit; then the
  hidden test files and the test patch; then pytest runs the named test files under
  :mod:`handlers.swe.run_tests` (which leaves no process behind) with a JUnit XML report in a directory
  outside the repository whose random name the host chose. The host reads that report from the workspace
  directory (no symlink followed) and parses it as XML; pytest's output is never read for the verdict.
  Reward 1.0 when every FAIL_TO_PASS and PASS_TO_PASS test is in the report and passed (a missing one counts
  as failed), else 0.0; ``extra["eval"]`` has each test's status, whether the patch applied, which paths were
  restored and why, and the output tail. That score is the ``outcome`` component; the process terms
  ``tool_call_errors`` and ``language_mixing`` (:mod:`prorl_server.rewards`, weight 0 unless the request's
  ``reward_weights`` names them) are added to it.
"""
from __future__ import annotations

import asyncio
import importlib.resources
import secrets
import shlex
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from handlers.swe.harness import (FAILED, PASSED, ReportError, harness_paths, parse_nul_list, parse_numstat,
                                  parse_status, file_of_test, report_statuses, report_verdict)
from handlers.swe.patch_check import MAX_PATCH_BYTES, WAIVABLE, PatchCheck, check_patch, config_files
from handlers.swe.run_tests import TIMEOUT_EXIT
from prorl_server.cpu_pool import CpuTimeoutError
from prorl_server.plugin import (AgentConfig, AgentHandler, InfrastructureError, InvalidInstanceError,
                                 NotRegradableError, preparing_sandbox)
from prorl_server.plugin.toolkit import run_agent, sandbox_tools
from prorl_server.plugin import STANDARD_TERMS, compose_reward, process_terms_async
from sandbox import Limits, SandboxSpec, ToolError

REPO_SRC = "/repo_src"
DEFAULT_TEST_COMMAND = "python -m pytest"
# Appended to the instance's pytest invocation. The configuration files are the base commit's (restored), so
# their addopts stay; these only pin what the verdict depends on: node ids relative to the repository root,
# no cache state between runs, and a report whose test names are plain node ids.
PYTEST_OPTIONS = ("-p", "no:cacheprovider", "--rootdir=.", "-o", "junit_family=xunit2", "-o", "junit_prefix=",
                  "-o", "junit_logging=no", "-o", "junit_log_passing_tests=false")
PATCH_FILE = "prorl_patch.diff"
GRADER_DIR_PREFIX = ".prorl-grader-"
RUNNER_NAME = "run_tests.py"
REPORT_NAME = "junit.xml"
_RUNNER_SOURCE = importlib.resources.files("handlers.swe").joinpath(RUNNER_NAME).read_bytes()
# Every difference from the index (the base commit: ``git apply`` leaves the index alone), ignored files too.
_STATUS = "git status --porcelain=v1 -z --untracked-files=all --ignored=traditional --no-renames"
SYSTEM_PROMPT = ("You are a software engineer fixing an issue in a git repository. Inspect the code, make the "
                 "smallest correct change, optionally run the tests, then call finish.")
DEFAULT_MAX_TURNS = 20
DEFAULT_EVAL_TIMEOUT_S = 600.0
#: Longest the parse of one JUnit report (at most 32 MiB) may take in a CPU-pool worker, seconds (~1 s is typical).
REPORT_PARSE_TIMEOUT_S = 30.0
#: Status of a test that was not run (the patch was flagged before its tests could run).
NOT_RUN = "NOT_RUN"
#: Wall-clock limit of the patch check in a CPU worker, seconds (it reads at most 1 MiB: well under a second).
PATCH_CHECK_TIMEOUT_S = 60.0
#: Base-commit configuration files (tox.ini, setup.cfg, pyproject.toml) read for the patch check, and the bytes
#: read of each; past these, the check judges a file's changed lines by themselves.
MAX_CONFIG_FILES, MAX_CONFIG_BYTES = 8, 1 << 20


class SweInstance(BaseModel):
    """A ``swe`` instance (see the module docstring); other keys are allowed."""

    model_config = ConfigDict(extra="allow")

    problem_statement: str = ""
    repo: Optional[str] = Field(default=None, description="host path of a git repository (bubblewrap/local)")
    repo_path: Optional[str] = Field(default=None, description="the repository's path inside image")
    image: Optional[str] = None
    test_command: Optional[str] = Field(default=None, description="a pytest invocation (default "
                                        f"{DEFAULT_TEST_COMMAND!r})")
    test_files: Optional[dict[str, str]] = Field(default=None, description="hidden test files written at eval")
    test_patch: Optional[str] = None
    FAIL_TO_PASS: list[str] = Field(default_factory=list, description="test ids that must pass")
    PASS_TO_PASS: list[str] = Field(default_factory=list, description="test ids that must keep passing")
    max_turns: Optional[int] = Field(default=None, ge=1)
    eval_timeout_s: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False)
    patch_check_allow: list[str] = Field(default_factory=list, description="rules of the patch check this "
                                         "instance waives (e.g. pytest_hook for a pytest plugin's repository)")

    @field_validator("patch_check_allow")
    @classmethod
    def _waivable(cls, rules: list[str]) -> list[str]:
        unknown = sorted(set(rules) - WAIVABLE)
        if unknown:
            raise ValueError(f"not rules the patch check can waive: {unknown}; those are {sorted(WAIVABLE)}")
        return rules

    @model_validator(mode="after")
    def _has_repository(self) -> "SweInstance":
        if not self.repo and not self.repo_path:
            raise ValueError("swe instance needs 'repo' (host path) or 'repo_path' (path inside the image)")
        return self


class SweSettings(BaseModel):
    """The ``swe`` handler's settings (``handlers: {swe: {...}}``): defaults for instances that set none."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(default=DEFAULT_MAX_TURNS, ge=1)
    eval_timeout_s: float = Field(default=DEFAULT_EVAL_TIMEOUT_S, gt=0, description="the test run's limit, s")


def _spec(instance: dict[str, Any]) -> Any:
    binds = [(instance["repo"], REPO_SRC, True)] if instance.get("repo") else []
    return SandboxSpec(image=instance.get("image"), binds=binds, network="none",
                       limits=Limits(max_processes=512, max_memory_bytes=8 << 30))


async def _checkout(handle, instance: dict[str, Any]) -> str:
    """Copy the repository into the workspace; returns the starting commit.

    Raises:
        InfrastructureError: ``harness`` kind, the copy failed (no model action has run yet).
    """
    src = REPO_SRC if instance.get("repo") else instance["repo_path"]
    r = await handle.bash(f"mkdir -p ~/repo && cp -a {shlex.quote(src)}/. ~/repo/ 2>&1 && "
                          "git -C ~/repo rev-parse HEAD", timeout_s=300)
    if r.exit_code != 0:
        raise InfrastructureError("harness", f"could not copy the repository from {src}: {r.output[-1000:]}")
    return r.output.strip().splitlines()[-1]


@dataclass(slots=True)
class SweState:
    """What a ``swe`` job carries between stages (``job.state``)."""

    sandbox: Any = None  # the run sandbox, with the repository copied into ~/repo
    base_commit: str = ""  # the commit the agent started from
    patch: str = ""  # what the agent changed (git diff against base_commit), taken when run ends
    patch_error: Optional[str] = None  # why no patch could be taken (the agent's doing: graded as empty)


class SweHandler(AgentHandler):
    """Instance: :class:`SweInstance` (see the module docstring); optional ``max_turns`` and
    ``eval_timeout_s`` override the settings (:class:`SweSettings`: 20 turns, 600 s)."""

    name = "swe"
    needs_sandbox = True
    aliases = ("swe_gym", "r2e_gym")
    needs_llm = True
    instance_model = SweInstance
    settings_model = SweSettings
    state_model = SweState
    reward_terms = STANDARD_TERMS  # tool-call parse errors, language mixing: weight 0 unless the request asks

    async def init(self, job) -> None:
        inst = job.instance
        handle = await job.open_sandbox(_spec(inst))
        job.state.base_commit = await _checkout(handle, inst)
        job.state.sandbox = handle

    async def run(self, job) -> None:
        handle = job.state.sandbox
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": "The repository is in ./repo (bash starts in its parent "
                     f"directory). Fix this issue:\n\n{job.instance.get('problem_statement', '')}"}]
        try:
            await run_agent(job, messages, sandbox_tools(handle, ("bash", "str_replace_editor")),
                            AgentConfig(max_turns=int(job.instance.get("max_turns") or self.settings.max_turns)))
        finally:
            job.state.patch, job.state.patch_error = await self._take_patch(handle, job.state.base_commit)

    @staticmethod
    async def _take_patch(handle, base: str) -> tuple[str, str | None]:
        """(patch, None), or ("", why) when the agent left its repository in a state git cannot diff (a
        deleted ``.git``, a stale lock, a patch over the transfer limit): the agent's doing, so it is graded
        as an empty patch, not failed as an infrastructure fault. A dead sandbox still raises."""
        # cd ~ (the workspace in every runtime): the agent may have left the shell anywhere.
        # Byte-code caches from the agent's own test runs are not part of a fix.
        r = await handle.bash(f"cd ~/repo && git add -A -- . ':(exclude,glob)**/__pycache__/**' "
                              f"':(exclude,glob)**/*.pyc' && git diff --cached --binary --no-ext-diff "
                              f"--no-textconv {base} > ../{PATCH_FILE}; s=$?; cd ..; exit $s", timeout_s=120)
        if r.exit_code != 0:
            return "", f"git could not take the patch: {r.output[-1000:]}"
        try:
            return (await handle.download(PATCH_FILE)).decode("utf-8", errors="surrogateescape"), None
        except ToolError as e:
            return "", f"the patch could not be downloaded: {e}"

    def restore_for_eval(self, job, result) -> None:
        """Refused: eval grades the patch that run took from the sandbox's repository (``git diff`` against
        the base commit), and the result records only its size (``extra["eval"]["patch_bytes"]``)."""
        raise NotRegradableError("the swe handler grades the patch its run stage took from the run sandbox's "
                                 "repository; the result does not record the patch, so it cannot be re-graded")

    async def eval(self, job) -> None:
        await self._grade(job)
        if job.failure_kind is None:  # the outcome, plus the opted-in process terms (a failure earns none)
            compose_reward(job, job.reward, await process_terms_async(job))

    async def _grade(self, job) -> None:
        inst = job.instance
        patch = job.state.patch
        info: dict[str, Any] = {"patch_bytes": len(patch.encode("utf-8", "surrogateescape")),
                                "patch_error": job.state.patch_error}
        # Until the patch is uploaded nothing of the model's is in this fresh sandbox: whatever fails preparing
        # it (the sandbox dying, the copy) is the system's, a start failure even though the model acted.
        with preparing_sandbox("the grading sandbox"):
            handle = await job.open_sandbox(_spec(inst))
            base = await _checkout(handle, inst)
            # The grader's own directory: in the workspace but outside the repository, its name random and chosen
            # here, created before any code of the patch can run.
            grader = f"{GRADER_DIR_PREFIX}{secrets.token_hex(12)}"
            await handle.upload(f"{grader}/{RUNNER_NAME}", _RUNNER_SOURCE)
            base_files = parse_nul_list(await _git_output(
                handle, f"git ls-tree -r -z --name-only --full-tree {base}", grader, "base-files"))
        named = {file_of_test(t) for t in (*inst.get("FAIL_TO_PASS", []), *inst.get("PASS_TO_PASS", []))}
        named.update(inst.get("test_files") or {})
        if inst.get("test_patch"):
            await handle.upload(f"{grader}/test.diff", inst["test_patch"].encode("utf-8", "surrogateescape"))
            named.update(parse_numstat(await _git_output(handle, f"git apply --numstat -z ../{grader}/test.diff",
                                                         grader, "test-numstat")))
        if patch.strip():
            check = await _check_patch(job, handle, base, grader, patch, base_files, named)
            info["flagged"], info["flagged_total"] = [f.as_dict() for f in check.findings], check.total
            if check.flagged:
                # The reward is decided: running code aimed at the grader would only cost the eval pool its time.
                not_run = {k: {t: NOT_RUN for t in inst.get(k, [])} for k in ("FAIL_TO_PASS", "PASS_TO_PASS")}
                info.update(patch_applied=False, harness_restored={}, tests_run=False, **not_run)
                job.reward, job.resolved, job.extra["eval"] = 0.0, False, info
                return
            before = parse_status(await _git_output(handle, _STATUS, grader, "status-before"))
            await handle.upload(f"{grader}/{PATCH_FILE}", patch.encode("utf-8", "surrogateescape"))
            r = await handle.bash(f"cd ~/repo && git apply --whitespace=nowarn ../{grader}/{PATCH_FILE}",
                                  timeout_s=120)
            info["patch_applied"] = r.exit_code == 0
            if r.exit_code != 0:
                info["apply_error"] = r.output[-2000:]
                job.reward, job.resolved, job.extra["eval"] = 0.0, False, info
                return
            touched = set(parse_numstat(await _git_output(
                handle, f"git apply --numstat -z ../{grader}/{PATCH_FILE}", grader, "numstat")))
            after = parse_status(await _git_output(handle, _STATUS, grader, "status-after"))
            touched.update(entry[3:].rstrip("/") for entry in after - before)
            # up to ~20k paths a 1 MiB patch can name: 0.15 s of matching, off the event loop
            try:
                restored = await _off_loop(job, harness_paths, touched, base_files, named,
                                           timeout_s=PATCH_CHECK_TIMEOUT_S)
            except CpuTimeoutError as e:  # bounded input (the patch's size): a time-out is the machine's
                raise InfrastructureError("harness", f"sorting the patch's paths ran past {PATCH_CHECK_TIMEOUT_S:g} s: "
                                                     f"{e}") from None
            if restored:
                await self._restore(handle, base, grader, restored, set(base_files))
            info["harness_restored"] = restored
        else:
            info["patch_applied"], info["harness_restored"] = False, {}
            info["flagged"], info["flagged_total"] = [], 0
        for path, text in (inst.get("test_files") or {}).items():
            await handle.upload(f"repo/{path}", text.encode())
        if inst.get("test_patch"):
            r = await handle.bash(f"cd ~/repo && git apply --whitespace=nowarn ../{grader}/test.diff", timeout_s=120)
            if r.exit_code != 0:
                raise InvalidInstanceError(f"the instance's test_patch does not apply on the base commit: {r.output[-1000:]}")
        await self._run_tests(job, handle, grader, info, self.settings.eval_timeout_s)

    @staticmethod
    async def _restore(handle, base: str, grader: str, paths: dict[str, str], base_files: set[str]) -> None:
        """Delete every harness path the patch touched, then check out from ``base`` those the base commit
        has. Runs before any code of the patch does. Raises InfrastructureError (``harness``) if git fails."""
        await handle.upload(f"{grader}/harness-all", b"\0".join(p.encode("utf-8", "surrogateescape") for p in paths))
        in_base = [p for p in paths if p in base_files]
        await handle.upload(f"{grader}/harness-base", b"\0".join(p.encode("utf-8", "surrogateescape") for p in in_base))
        # Literal pathspecs: a file name with * or [ must not match other files.
        cmd = (f"cd ~/repo && xargs -0 -r rm -rf -- < ../{grader}/harness-all"
               + (f" && GIT_LITERAL_PATHSPECS=1 git checkout {base} --pathspec-from-file=../{grader}/harness-base "
                  "--pathspec-file-nul" if in_base else ""))
        r = await handle.bash(cmd, timeout_s=120)
        if r.exit_code != 0:
            raise InfrastructureError("harness", f"could not restore the test harness from {base}: {r.output[-1000:]}")

    @staticmethod
    async def _run_tests(job, handle, grader: str, info: dict[str, Any],
                         default_timeout_s: float = DEFAULT_EVAL_TIMEOUT_S) -> None:
        inst = job.instance
        timeout_s = float(inst.get("eval_timeout_s") or default_timeout_s)
        ids = {"FAIL_TO_PASS": list(inst.get("FAIL_TO_PASS", [])), "PASS_TO_PASS": list(inst.get("PASS_TO_PASS", []))}
        files = sorted({file_of_test(t) for t in (*ids["FAIL_TO_PASS"], *ids["PASS_TO_PASS"])})
        report_rel = f"{grader}/{REPORT_NAME}"
        pytest_cmd = " ".join([inst.get("test_command") or DEFAULT_TEST_COMMAND, *PYTEST_OPTIONS,
                               shlex.quote(f"--junit-xml={handle.workdir}/{report_rel}"), "--",
                               *map(shlex.quote, files)])
        r = await handle.bash(
            f"cd ~/repo && \"$(command -v python3 || command -v python)\" -I -S ../{grader}/{RUNNER_NAME} "
            f"--timeout {timeout_s:g} -- bash -c {shlex.quote(pytest_cmd)}", timeout_s=timeout_s + 60)
        # Read on the host, from the workspace directory, without following links; stdout is never read for
        # the verdict (the tests share it).
        args = (handle.workspace, report_rel, ids["FAIL_TO_PASS"], ids["PASS_TO_PASS"])
        try:
            f2p, p2p, any_failed = await _off_loop(job, report_verdict, *args, timeout_s=REPORT_PARSE_TIMEOUT_S)
            info["report_error"] = None
        except (ReportError, CpuTimeoutError) as e:
            # the report's size and shape are the tested code's doing: one that cannot be read in time is no
            # report (every test MISSING, a scored 0), never a stalled server or a filtered sample
            info["report_error"] = str(e) or f"the report took longer than {REPORT_PARSE_TIMEOUT_S:g} s to parse"
            f2p, p2p = report_statuses(ids["FAIL_TO_PASS"], {}), report_statuses(ids["PASS_TO_PASS"], {})
            any_failed = False
        info.update(FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, tests_run=True,
                    timed_out=r.timed_out or r.exit_code == TIMEOUT_EXIT, test_exit_code=r.exit_code,
                    output_tail=r.output[-3000:])
        tests = {**f2p, **p2p}
        # pytest exits 1 exactly when a test failed or errored; a report that shows none then was rewritten after
        # pytest wrote it (code the tests imported can do that at exit): its verdict is not the tests'
        if r.exit_code == 1 and not any_failed:
            info["report_inconsistent"] = ("pytest exited 1 (a test failed) and the report shows no failure: the "
                                           "report was rewritten after pytest wrote it")
            tests = {**tests, "<report>": FAILED}
        job.resolved = bool(tests) and all(s == PASSED for s in tests.values())
        job.reward = 1.0 if job.resolved else 0.0
        job.extra["eval"] = info


async def _check_patch(job, handle, base: str, grader: str, patch: str, base_files: list[str],
                       named: set[str]) -> PatchCheck:
    """:func:`handlers.swe.patch_check.check_patch` on the patch, in the server's CPU pool (in a thread where
    the job has none), with the base text of the configuration files it changes (read with git from the fresh
    checkout, before the patch is applied). The check reads bounded plain text, so a time-out is the machine's
    fault: it raises InfrastructureError (``harness``), as does git failing."""
    texts = {}
    # (a patch over the check's limit is flagged unread: no need for them)
    for path in config_files(patch, base_files)[:MAX_CONFIG_FILES] if len(patch) <= MAX_PATCH_BYTES else ():
        blob = shlex.quote(f"{base}:{path}")
        data = await _git_output(handle, f"git cat-file blob {blob} | head -c {MAX_CONFIG_BYTES}", grader,
                                 "config-base")
        texts[path] = data.decode("utf-8", "surrogateescape")
    args = (patch, base_files, sorted(named), tuple(job.instance.get("patch_check_allow") or ()), texts)
    try:
        return await _off_loop(job, check_patch, *args, timeout_s=PATCH_CHECK_TIMEOUT_S)
    except CpuTimeoutError as e:
        raise InfrastructureError("harness", f"the patch check ran past {PATCH_CHECK_TIMEOUT_S:g} s: {e}") from None


async def _off_loop(job, fn, *args, timeout_s: float):
    """``fn(*args)`` in the server's CPU pool (``job.run_cpu``), or in a thread where the job has none: for work
    whose size the policy shapes (its patch's paths, the report its code wrote), which must not stall the
    event loop. Raises :class:`CpuTimeoutError` past ``timeout_s`` (pool only) and whatever ``fn`` raises."""
    if job.services.cpu_pool is None:
        return await asyncio.to_thread(fn, *args)
    return await job.run_cpu(fn, *args, timeout_s=timeout_s)


async def _git_output(handle, git_cmd: str, grader: str, name: str) -> bytes:
    """Run ``git_cmd`` in the repository with its output to a file of the grader directory, and download it
    (binary-safe: NUL-separated lists do not travel through the terminal). Only used while no code of the
    patch has run. Raises InfrastructureError (``harness``) when git fails."""
    r = await handle.bash(f"cd ~/repo && {git_cmd} > ../{grader}/{name}", timeout_s=120)
    if r.exit_code != 0:
        raise InfrastructureError("harness", f"{git_cmd.split(' -')[0]} failed in the eval sandbox: {r.output[-1000:]}")
    return await handle.download(f"{grader}/{name}")
