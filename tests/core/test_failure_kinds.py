"""Who acted decides: failures the model did not cause are never training data (each class ends the job with
its ``failure_kind`` and ``filter: true``), and what the model caused after it acted (its sandbox dying or
stalling, a host reader raising on what it shaped, a stall past the deadline) is a scored 0.0 with
``filter: false`` and its trajectories kept: a filtered sample gets no negative advantage, so a policy that
could crash its way out of a problem would learn to.

The fast tests run the real server (pipeline, agent loop, HTTP) with a fault-injecting handler whose stages
raise the exact exception classes of the real components (``sandbox.errors``, the LLM client, the balancer),
and, for the agent loop, a tool function raising them on the scripted policy's call. The real-tier test kills
a real bubblewrap sandbox in the middle of a ``code`` rollout.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from prorl_server.llm.agent_loop import AgentConfig
from prorl_server.plugin.handler import AgentHandler, InfrastructureError, InvalidInstanceError
from prorl_server.balancer import NoBackendError
from prorl_server.failures import FAILURE_KINDS, classify
from prorl_server.llm.client import LLMRequestError, LLMUnavailableError
from sandbox.errors import (EditorError, FileTransferError, ProtocolError, SandboxClosedError, SandboxDeadError,
                            SandboxError, SandboxEvictedError, SandboxStartError, ToolError, ToolTimeout)


def _chained(outer, cause):
    try:
        raise outer from cause
    except type(outer) as e:
        return e


FAULTS = {
    "SandboxDeadError": lambda: SandboxDeadError("sandbox sb-1: its processes are gone"),
    "SandboxEvictedError": lambda: SandboxEvictedError("sandbox sb-1: ended for the host's free space",
                                                       reason="host_disk"),
    "SandboxClosedError": lambda: SandboxClosedError("call on a closed sandbox"),
    "SandboxStartError": lambda: SandboxStartError("sandbox did not become ready: bwrap: No permissions"),
    "ProtocolError": lambda: ProtocolError("sandbox sb-1: invalid response"),
    "ToolTimeout": lambda: ToolTimeout("sandbox sb-1: no answer to bash within the timeout plus 10 s"),
    "LLMUnavailableError": lambda: LLMUnavailableError("every backend failed"),
    "LLMRequestError": lambda: LLMRequestError(400, "bad request"),
    "NoBackendError": lambda: NoBackendError("no backend registered within 30 s"),
    "harness": lambda: InfrastructureError("harness", "the grader printed no verdict"),
    "agent_missing": lambda: InfrastructureError("agent_missing", "bash: my-agent: command not found"),
    "InvalidInstanceError": lambda: InvalidInstanceError("instance needs 'question'"),
    "ValueError": lambda: ValueError("instance.expression must be a string"),
    "RuntimeError": lambda: RuntimeError("a handler bug"),
    "KeyError": lambda: KeyError("state"),
    "ToolError": lambda: ToolError("a handler's own sandbox call was refused"),
    "RuntimeError_from_SandboxDeadError": lambda: _chained(RuntimeError("could not copy the repository"),
                                                           SandboxDeadError("gone")),
    "ExceptionGroup": lambda: ExceptionGroup("task group", [RuntimeError("sibling"), SandboxDeadError("gone")]),
}


class FaultyHandler(AgentHandler):
    """Fault injection: ``{"data_source": "faulty", "raise": "<FAULTS key>", "in": "run"}`` raises that
    exception in that stage (each stands for what the real component raises: a dead bubblewrap sandbox, an
    unreachable vLLM backend, a grader that gave no verdict...); ``"declare": "harness"`` sets
    ``job.failure_kind`` and returns; ``"override": "harness"`` sets it in the exception callback;
    ``"own_result": true`` builds a result in ``final_result`` that forgets the failure. Without a fault the
    job succeeds with ``reward``."""

    name = "faulty"
    needs_llm = False

    async def _stage(self, job, stage):
        inst = job.instance
        if inst.get("in", "run") != stage:
            return
        if inst.get("declare"):
            job.failure_kind = inst["declare"]
            return
        if inst.get("raise"):
            raise FAULTS[inst["raise"]]()

    async def init(self, job):
        await self._stage(job, "init")

    async def run(self, job):
        job.messages = [{"role": "assistant", "content": "partial"}]
        await self._stage(job, "run")

    async def eval(self, job):
        job.reward = float(job.instance.get("reward", 1.0))
        job.resolved = job.reward > 0
        await self._stage(job, "eval")

    async def run_exception(self, job, exc):
        if job.instance.get("override"):
            job.failure_kind = job.instance["override"]

    async def final_result(self, job):
        if job.instance.get("own_result"):
            from prorl_server.types import JobResult

            return JobResult(job_id=job.job_id, trajectory_id=job.trajectory_id, handler=job.handler_name,
                             critical_error=job.critical_error, error=job.error)
        return await super().final_result(job)


@pytest.fixture
def registry(registry):
    registry.register(FaultyHandler())
    return registry


async def process(client, instance, **body):
    r = await client.post("/process", json={"instance": instance, **body})
    assert r.status == 200, await r.text()
    return await r.json()


EXPECTED = [
    ("SandboxDeadError", "run", "sandbox"), ("SandboxClosedError", "eval", "sandbox"),
    ("SandboxStartError", "init", "sandbox"), ("ProtocolError", "run", "sandbox"),
    ("ToolTimeout", "eval", "sandbox"), ("LLMUnavailableError", "run", "llm_backend"),
    ("LLMRequestError", "run", "configuration"), ("NoBackendError", "run", "llm_backend"),
    ("harness", "eval", "harness"), ("agent_missing", "run", "agent_missing"),
    ("InvalidInstanceError", "run", "invalid_instance"), ("ValueError", "init", "invalid_instance"),
    ("ValueError", "run", "handler"), ("RuntimeError", "run", "handler"), ("KeyError", "eval", "handler"),
    ("ToolError", "init", "handler"), ("RuntimeError_from_SandboxDeadError", "init", "sandbox"),
    ("ExceptionGroup", "run", "sandbox"),
]


@pytest.mark.parametrize("fault,stage,kind", EXPECTED, ids=[f"{f}-in-{s}" for f, s, _ in EXPECTED])
async def test_each_failure_class_gets_its_kind_and_is_filtered(make_client, fault, stage, kind):
    client = await make_client()
    body = await process(client, {"data_source": "faulty", "raise": fault, "in": stage})
    assert (body["critical_error"], body["failure_kind"], body["filter"]) == (stage, kind, True), body["error"]
    assert body["reward"] == 0.0 or stage == "eval"
    assert body["resolved"] is False
    assert kind in FAILURE_KINDS


async def test_normal_outcomes_are_not_filtered_whatever_the_reward(make_client):
    client = await make_client()
    for inst in ({"data_source": "faulty", "reward": 1.0}, {"data_source": "faulty", "reward": 0.0},
                 {"data_source": "arithmetic", "expression": "1+1", "answer": 3}):  # a wrong answer
        body = await process(client, inst)
        assert (body["critical_error"], body["failure_kind"], body["filter"]) == (None, None, False), body


async def test_job_timeout_and_cancel_are_filtered(make_client):
    client = await make_client()
    body = await process(client, {"data_source": "scripted", "sleep": {"run": 30}}, timeout_s=0.3)
    assert (body["critical_error"], body["failure_kind"], body["filter"]) == ("timeout", "timeout", True)

    r = await client.post("/jobs", json={"instance": {"data_source": "scripted", "sleep": {"run": 30}}})
    job_id = (await r.json())["job_id"]
    for _ in range(500):  # wait until it runs, then cancel it there
        s = await (await client.get(f"/jobs/{job_id}")).json()
        if s["state"] == "run":
            break
        await asyncio.sleep(0.01)
    assert (await client.post("/cancel", json={"job_id": job_id})).status == 200
    s = await (await client.get(f"/jobs/{job_id}")).json()
    res = s["result"]
    assert (res["critical_error"], res["failure_kind"], res["filter"]) == ("cancelled", "cancelled", True)


async def test_a_handler_declares_overrides_and_cannot_drop_the_failure_kind(make_client):
    client = await make_client()
    declared = await process(client, {"data_source": "faulty", "declare": "harness", "in": "run"})
    assert (declared["critical_error"], declared["failure_kind"], declared["filter"]) == ("run", "harness", True)
    assert "harness" in declared["error"]
    overridden = await process(client, {"data_source": "faulty", "raise": "RuntimeError", "override": "harness"})
    assert (overridden["failure_kind"], overridden["filter"]) == ("harness", True)
    own = await process(client, {"data_source": "faulty", "raise": "SandboxDeadError", "own_result": True})
    assert (own["critical_error"], own["failure_kind"], own["filter"]) == ("run", "sandbox", True)


async def test_filtered_jobs_are_counted_by_kind_in_metrics(make_client):
    client = await make_client()
    for fault in ("SandboxDeadError", "SandboxDeadError", "LLMUnavailableError"):
        await process(client, {"data_source": "faulty", "raise": fault})
    await process(client, {"data_source": "faulty"})
    from prometheus_client.parser import text_string_to_metric_families

    text = await (await client.get("/metrics")).text()
    counts = {(s.labels["handler"], s.labels["failure_kind"]): s.value
              for f in text_string_to_metric_families(text) if f.name == "prorl_jobs_filtered"
              for s in f.samples if s.name == "prorl_jobs_filtered_total"}
    assert counts == {("faulty", "sandbox"): 2.0, ("faulty", "llm_backend"): 1.0}


def test_classification_rules():
    assert classify(FileTransferError("no such file"), "run") == "handler"  # a ToolError is never infrastructure
    assert classify(ValueError("x"), "init") == "invalid_instance"
    assert classify(ValueError("x"), "eval") == "handler"
    cyclic = RuntimeError("a")
    cyclic.__cause__ = RuntimeError("b")
    cyclic.__cause__.__cause__ = cyclic
    assert classify(cyclic, "run") == "handler"
    with pytest.raises(ValueError, match="unknown failure kind"):
        InfrastructureError("flaky", "not a kind")


# ------------------------------------------------------------------------------------------ the agent loop
class ToolAgentHandler(AgentHandler):
    """The generic agent loop (``prorl_server.plugin.toolkit.run_agent``) with one tool, ``probe``, that raises the
    instance's ``fault`` (a :data:`FAULTS` key: the exception classes a sandbox tool's client raises), or
    answers ``"ok"`` without one. Stands in for a sandbox handler whose sandbox fails in the middle of a turn."""

    name = "tool_agent"
    needs_llm = True

    async def run(self, job):
        from prorl_server.plugin.toolkit import run_agent
        from prorl_server.llm.agent_loop import AgentConfig

        async def probe(args):
            if job.instance.get("fault"):
                raise FAULTS[job.instance["fault"]]()
            return "ok"

        tools = {"probe": ({"type": "object", "properties": {}}, probe)}
        await run_agent(job, [{"role": "user", "content": "Probe, then finish."}], tools, AgentConfig(max_turns=4))

    async def eval(self, job):
        job.reward = 1.0 if job.extra["agent"]["finish_reason"] == "stop" else 0.0


def tool_call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def probe_then_finish(prompt, turn):
    return tool_call("probe") if turn == 0 else tool_call("finish", answer="done")


@pytest.mark.parametrize("fault,kind,filtered", [
    (None, None, False), ("ToolError", None, False),
    # after the model's turn its sandbox dying or stalling is its doing: scored 0.0, trained on
    ("SandboxDeadError", "model_crashed_sandbox", False), ("ProtocolError", "model_crashed_sandbox", False),
    ("ToolTimeout", "model_stalled_sandbox", False), ("RuntimeError", None, False),
    # faults the handler or the infrastructure declares stay filtered
    ("harness", "harness", True), ("SandboxStartError", "sandbox", True),
    # the host evicted the sandbox within its bounds for the node's free disk: the system's, after the model too
    ("SandboxEvictedError", "sandbox", True)])
async def test_agent_loop_tool_errors_are_observations_and_model_caused_faults_are_scored(
        registry, make_client, scripted_policy, fault, kind, filtered):
    registry.register(ToolAgentHandler)
    client = await make_client(backends=[await scripted_policy(probe_then_finish)])
    body = await process(client, {"data_source": "tool_agent", "fault": fault}, sampling_params={"max_tokens": 256})
    if kind is None:  # the model's doing: a trainable trajectory, the error (if any) was its observation
        assert (body["critical_error"], body["failure_kind"], body["filter"]) == (None, None, False), body["error"]
        assert body["reward"] == 1.0 and body["trajectories"]
        (obs,) = [m["content"] for m in body["messages"] if m["role"] == "tool"]
        assert obs == ("ok" if fault is None else "Error: tool 'probe' failed: ToolError: a handler's own "
                       "sandbox call was refused" if fault == "ToolError" else
                       "Error: tool 'probe' failed: RuntimeError: a handler bug")
        return
    assert (body["critical_error"], body["failure_kind"], body["filter"]) == ("run", kind, filtered)
    assert body["reward"] == 0.0 and body["resolved"] is False
    assert not any(m["role"] == "tool" for m in body["messages"])  # never shown to the model
    assert len(scripted_policy.returned) == 1  # no turn was generated after the fault
    # what the model did is kept either way: its one turn, token for token
    (traj,) = body["trajectories"]
    assert traj["response_ids"] == scripted_policy.returned[0][0]
    assert body["extra"]["agent"]["finish_reason"] == "error"


class HostReaderHandler(AgentHandler):
    """A handler whose run stage reads back what the model's turn shaped, as a host-side reader would (a file
    the model turned into a directory, a value too deep to encode): the reader raises on it after the
    model acted. ``"before": true`` raises the same before any turn (a handler bug: filtered)."""

    name = "host_reader"
    needs_llm = True

    async def run(self, job):
        from prorl_server.plugin.toolkit import run_agent

        if job.instance.get("before"):
            raise IsADirectoryError(21, "Is a directory", "/workspace/solution.py")
        await run_agent(job, [{"role": "user", "content": "Write the file."}], {}, AgentConfig(max_turns=1))
        raise IsADirectoryError(21, "Is a directory", "/workspace/solution.py")  # the model made it a directory


async def test_a_host_reader_raising_on_what_the_model_shaped_is_scored_not_filtered(
        registry, make_client, scripted_policy):
    registry.register(HostReaderHandler)
    client = await make_client(backends=[await scripted_policy(lambda p, t: "done")])
    after = await process(client, {"data_source": "host_reader"}, sampling_params={"max_tokens": 64})
    assert (after["critical_error"], after["failure_kind"], after["filter"]) == ("run", "model_error", False)
    assert after["reward"] == 0.0 and after["trajectories"] and "IsADirectoryError" in after["error"]
    before = await process(client, {"data_source": "host_reader", "before": True}, sampling_params={"max_tokens": 64})
    assert (before["critical_error"], before["failure_kind"], before["filter"]) == ("run", "handler", True)


class StallingToolHandler(AgentHandler):
    """The agent loop with one sandbox-like tool that never answers (a model that stalls its own sandbox),
    under a job ``timeout_s`` far below the tool's own limits."""

    name = "stalling_tool"
    needs_llm = True

    async def run(self, job):
        from prorl_server.plugin.toolkit import run_agent

        async def probe(args):
            await asyncio.sleep(3600)

        probe.timeout_s = 600.0
        tools = {"probe": ({"type": "object", "properties": {}}, probe)}
        await run_agent(job, [{"role": "user", "content": "Probe."}], tools, AgentConfig(max_turns=4))


async def test_a_stall_past_the_job_deadline_after_the_model_acted_is_scored_with_its_trajectory(
        registry, make_client, scripted_policy):
    registry.register(StallingToolHandler)
    client = await make_client(backends=[await scripted_policy(probe_then_finish)])
    body = await process(client, {"data_source": "stalling_tool"}, sampling_params={"max_tokens": 256},
                         timeout_s=1.0)
    assert (body["critical_error"], body["failure_kind"], body["filter"]) == ("timeout", "model_timeout", False)
    assert body["reward"] == 0.0 and body["timing"]["timeout_triggered"]
    (traj,) = body["trajectories"]
    assert traj["response_ids"] == scripted_policy.returned[0][0]


async def test_scored_failures_are_counted_by_kind_in_metrics(registry, make_client, scripted_policy):
    registry.register(ToolAgentHandler)
    client = await make_client(backends=[await scripted_policy(probe_then_finish)])
    for fault in ("SandboxDeadError", "SandboxDeadError", "harness"):
        await process(client, {"data_source": "tool_agent", "fault": fault}, sampling_params={"max_tokens": 256})
    from prometheus_client.parser import text_string_to_metric_families

    text = await (await client.get("/metrics")).text()
    counts = {(s.labels["failure_kind"], s.labels["filtered"]): s.value
              for f in text_string_to_metric_families(text) if f.name == "prorl_jobs_failed"
              for s in f.samples if s.name == "prorl_jobs_failed_total"}
    assert counts == {("model_crashed_sandbox", "false"): 2.0, ("harness", "true"): 1.0}


def test_who_acted_decides_the_kind():
    from prorl_server.failures import SCORED_KINDS, is_filtered

    assert classify(SandboxDeadError("gone"), "run", model_acted=False) == "sandbox"
    assert classify(SandboxDeadError("gone"), "run", model_acted=True) == "model_crashed_sandbox"
    assert classify(SandboxDeadError("gone"), "eval", model_acted=True) == "model_crashed_sandbox"
    assert classify(SandboxDeadError("gone"), "init", model_acted=True) == "sandbox"
    assert classify(ToolTimeout("stuck"), "run", model_acted=True) == "model_stalled_sandbox"
    assert classify(SandboxStartError("no bwrap"), "eval", model_acted=True) == "sandbox"
    assert classify(_chained(RuntimeError("copy failed"), SandboxDeadError("gone")), "run", True) \
        == "model_crashed_sandbox"
    assert classify(RuntimeError("x"), "eval", model_acted=True) == "model_error"
    assert classify(LLMUnavailableError("down"), "run", model_acted=True) == "llm_backend"
    assert classify(InfrastructureError("sandbox", "declared"), "run", model_acted=True) == "sandbox"
    assert classify(InvalidInstanceError("bad"), "run", model_acted=True) == "invalid_instance"
    assert all(not is_filtered(k) for k in SCORED_KINDS) and is_filtered("sandbox") and not is_filtered(None)


# ------------------------------------------------------------------------------------------ real sandbox
@pytest.mark.real
@pytest.mark.parametrize("what", ["editor_error", "sandbox_killed", "model_kills_its_server"])
async def test_a_killed_sandbox_ends_a_code_rollout_scored_while_an_editor_error_is_an_observation(
        aiohttp_client, bwrap_runtime, scripted_policy, sandbox_procs, what):
    """A real ``code`` rollout in bubblewrap: the scripted policy's second turn edits a file that does not
    exist (an EditorError: the model's mistake, an observation), or, for ``sandbox_killed``, the sandbox's
    processes are killed (by pid, all of them children of this test) before that turn's tool call runs: after
    the model acted, a scored ``model_crashed_sandbox``."""
    import psutil

    from handlers.code.data import humaneval_problems, to_instance
    from prorl_server.plugin.registry import HandlerRegistry
    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings

    def script(prompt, turn):
        if turn == 0:
            return tool_call("bash", command="echo alive")
        if turn == 1 and what == "model_kills_its_server":  # the policy ends its own execution server
            return tool_call("bash", command="kill -9 $PPID")
        if turn == 1:
            if what == "sandbox_killed":
                for p in sandbox_procs():
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
            return tool_call("str_replace_editor", command="str_replace", path="/workspace/missing.py",
                             old_str="a", new_str="b")
        return tool_call("finish", answer="done")

    registry = HandlerRegistry()
    registry.load_entry_points()
    app = create_app(ServerSettings(backends=[await scripted_policy(script)], health_interval_s=3600),
                     registry=registry, sandbox_runtime=bwrap_runtime)
    client = await aiohttp_client(app)
    inst = to_instance(humaneval_problems()["HumanEval/0"])
    body = await process(client, inst, sampling_params={"max_tokens": 512})
    obs = [m["content"] for m in body["messages"] if m["role"] == "tool"]
    if what == "editor_error":
        assert (body["critical_error"], body["failure_kind"], body["filter"]) == (None, None, False), body["error"]
        assert obs[0].startswith("alive") and obs[1].startswith("Error: tool 'str_replace_editor' failed: ")
        assert body["trajectories"] and body["extra"]["agent"]["finish_reason"] == "stop"
    elif what == "model_kills_its_server":  # before: failure_kind "sandbox", filter true: re-rolled, never a 0.0
        assert (body["critical_error"], body["failure_kind"], body["filter"]) == \
            ("run", "model_crashed_sandbox", False), body
        assert body["reward"] == 0.0 and len(body["trajectories"][0]["response_ids"]) > 0
        assert "kill -9" in body["messages"][-1]["content"]  # what it did is in the result
    else:
        # killed after the model ran a command in it: the host cannot tell that kill from one of the model's own
        # (kill -9 $PPID), so it is scored, never re-rolled; its trajectory is kept
        assert (body["critical_error"], body["failure_kind"], body["filter"]) == \
            ("run", "model_crashed_sandbox", False), body
        assert "SandboxDeadError" in body["error"] and body["trajectories"]
    await bwrap_runtime.close_all()
    assert not sandbox_procs()


class LoudToolHandler(AgentHandler):
    """The agent loop with a tool whose output the model shapes: ``print(' the' * 2_500_000)`` in its kernel."""

    name = "loud_tool"
    needs_llm = True

    async def run(self, job):
        from prorl_server.plugin.toolkit import run_agent

        async def probe(args):
            return " the" * (10 ** 7 // 4)  # ten megabytes of a word that is one token

        tools = {"probe": ({"type": "object", "properties": {}}, probe)}
        await run_agent(job, [{"role": "user", "content": "Probe."}], tools, AgentConfig(max_turns=2))


async def test_a_ten_megabyte_observation_is_cut_before_it_is_tokenized(registry, make_client, scripted_policy):
    """Every observation is rendered and tokenized: ten megabytes of tool output cost the server ~38 s of
    tokenizing (red-team case T11). The default cut keeps 32768 characters and says how many it dropped."""
    import time

    registry.register(LoudToolHandler)
    client = await make_client(backends=[await scripted_policy(probe_then_finish)])
    t0 = time.perf_counter()
    body = await process(client, {"data_source": "loud_tool"}, sampling_params={"max_tokens": 256})
    assert time.perf_counter() - t0 < 10, body
    observations = [m["content"] for m in body["messages"] if m["role"] == "tool"]
    assert len(observations) == 1, {k: body[k] for k in ("error", "failure_kind", "extra")}
    obs = observations[0]
    assert obs.startswith(" the" * (32768 // 4)) and obs.endswith(f"[... {10 ** 7 - 32768} characters cut]")


async def test_the_observations_of_one_turn_are_bounded_together():
    """Sixty calls in one turn, each printing 40,000 characters: each output was cut, but 2.4 M characters were
    tokenized for the turn (~5 s of the server's CPU: second red-team pass). The turn's outputs share a budget."""
    from prorl_server.llm.agent_loop import AgentLoop
    from prorl_server.llm.tool_parser import ParsedTurn, ToolCall

    async def probe(args):
        return "\u4e00" * 40000

    loop = AgentLoop(None, None, {"probe": ({"type": "object", "properties": {}}, probe)}, AgentConfig())
    calls = [ToolCall(name="probe", arguments={}) for _ in range(60)]
    out, _, _ = await loop._run_tools(ParsedTurn(content="", calls=calls, items=list(calls)), {
        k: 0 for k in ("tool_calls", "tool_errors", "unknown_tool_calls", "tool_timeouts")})
    assert len(out) == 60
    assert sum(len(o["content"]) for o in out) < 65536 + 60 * 200, [len(o["content"]) for o in out][:5]
    assert "this turn's tool outputs passed 65536 characters" in out[1]["content"]


# ------------------------------------------------------------------------ opening a sandbox after the model
class EvalSandboxHandler(AgentHandler):
    """A task whose eval opens a fresh sandbox to grade (as the ``code`` handler's grading and ``swe``'s eval
    do) after the model's one turn: reward 1.0 for the answer ``42`` once the sandbox is open."""

    name = "eval_sandbox"
    needs_llm = True
    needs_sandbox = True

    async def run(self, job):
        from prorl_server.plugin.toolkit import run_agent

        result = await run_agent(job, [{"role": "user", "content": "Six times seven?"}], {},
                                 AgentConfig(max_turns=1))
        job.state["answer"] = result.messages[-1]["content"]

    async def eval(self, job):
        await job.open_sandbox()
        job.reward = 1.0 if job.state["answer"].strip() == "42" else 0.0
        job.resolved = job.reward == 1.0


class FaultyRuntime:
    """Fault injection: a TEST DOUBLE for a sandbox runtime (bubblewrap's ``start``) whose start raises what the
    real one raises while preparing a sandbox: the host's disk full while it makes the sandbox's directories,
    a cgroup the host refuses to create, a uid range with no free lease, an image that is not usable. With no
    fault it starts a handle that only records its close."""

    def __init__(self, fault) -> None:
        self.fault = fault

    async def start(self, spec=None, **kw):
        if self.fault is not None:
            raise self.fault

        class Handle:
            async def close(self):
                pass
        return Handle()

    async def close_all(self):
        pass

    async def reap_orphans(self):
        return 0


PREPARE_FAULTS = {
    "disk-full": OSError(28, "No space left on device", "/tmp/prorl-sandboxes/sb-1/workspace"),
    "cgroup-refused": PermissionError(13, "Permission denied", "/sys/fs/cgroup/prorl/sb-1/memory.max"),
    "uids-exhausted": SandboxStartError("no free sandbox uid in [100000, 165536): every name in the lease "
                                        "directory is taken"),
    "bad-image": SandboxError("bubblewrap image must be a rootfs directory, got '/img.sif'"),
}


@pytest.mark.parametrize("fault", [None, *PREPARE_FAULTS])
async def test_a_sandbox_that_cannot_be_prepared_for_eval_is_the_systems_after_a_right_answer(
        registry, aiohttp_client, scripted_policy, fault):
    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings

    registry.register(EvalSandboxHandler)
    backend = await scripted_policy(lambda prompt, turn: "42")
    app = create_app(ServerSettings(backends=[backend], health_interval_s=3600), registry=registry,
                     sandbox_runtime=FaultyRuntime(PREPARE_FAULTS.get(fault)))
    client = await aiohttp_client(app)
    body = await process(client, {"data_source": "eval_sandbox"}, sampling_params={"max_tokens": 16})
    if fault is None:  # the right answer, graded
        assert (body["reward"], body["failure_kind"], body["filter"]) == (1.0, None, False), body["error"]
        return
    # the model acted (its turn is kept in the record) and answered right: the sandbox that could not be
    # prepared is the system's, a filtered start failure, never a 0.0 the model is trained on
    assert body["trajectories"] and body["reward"] == 0.0
    assert (body["critical_error"], body["failure_kind"], body["filter"]) == ("eval", "sandbox", True), body["error"]


class SlowRuntime(FaultyRuntime):
    """A TEST DOUBLE for a runtime whose start takes ``delay_s`` (a loaded node, a wait for a uid lease or a
    loopback address): the sandbox opens, late."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(None)
        self.delay_s = delay_s

    async def start(self, spec=None, **kw):
        await asyncio.sleep(self.delay_s)
        return await super().start(spec, **kw)


async def test_time_spent_opening_eval_sandbox_is_not_charged_to_the_jobs_deadline(
        registry, aiohttp_client, scripted_policy):
    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings

    registry.register(EvalSandboxHandler)
    backend = await scripted_policy(lambda prompt, turn: "42")
    app = create_app(ServerSettings(backends=[backend], health_interval_s=3600), registry=registry,
                     sandbox_runtime=SlowRuntime(2.5))
    client = await aiohttp_client(app)
    body = await process(client, {"data_source": "eval_sandbox"}, sampling_params={"max_tokens": 16}, timeout_s=2.0)
    assert (body["reward"], body["failure_kind"], body["filter"]) == (1.0, None, False), body["error"]
    assert body["timing"]["counted_s"] < 2.0
