"""The ``cli_agent`` handler end to end: a small agent script using the real ``openai`` SDK runs inside a real
bubblewrap sandbox (no network), reaches its gateway session through the bound Unix socket, talks to the real
vLLM server, and its job result holds the trajectory of exactly vLLM's tokens and the reward of the code
handler's hidden tests, or the ``reward_info`` it posted with ``/complete``; failures that are not the
model's (no agent binary, an agent that dies before asking the model anything, an unreachable backend) end
the job with a ``failure_kind`` and ``filter: true``, while a present agent's own exit status is a normal
outcome; an instance with tests is never graded by the agent's ``reward_info`` unless it asks for it."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from prorl_server.plugin.handler import InvalidInstanceError
from handlers.cli_agent import CliAgentHandler
from handlers.cli_agent.handler import _eval_mode
from handlers.code.data import humaneval_problems, to_instance
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.gateway import GATEWAY
from prorl_server.types import Trajectory

AUTH = {"Authorization": "Bearer server-secret"}

# The agent: two chat turns with the SDK, then it writes the solution it was given (it stands for an agent that
# solves the task), and probes whether anything but its own session is reachable.
AGENT = r'''
import json, os, sys, urllib.request
from openai import OpenAI

client = OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY come from the launcher
messages = [{"role": "user", "content": "Write the function."}]
for turn in range(2):
    r = client.chat.completions.create(model="x", messages=messages, max_tokens=8, temperature=1.0, seed=turn)
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "Continue."}]
open("solution.py", "w").write(open("answer.txt").read())
probes = {}
for name, url in [("server_status", "http://127.0.0.1:%s/status" % os.environ["SERVER_PORT"]),
                  ("session_status", os.environ["PRORL_SESSION_URL"].rsplit(".", 1)[0] + "/v1/models")]:
    try:
        urllib.request.urlopen(url, timeout=3)
        probes[name] = "reached"
    except urllib.error.HTTPError as e:
        probes[name] = e.code
    except urllib.error.URLError as e:
        probes[name] = type(e.reason).__name__
print("PROBES " + json.dumps(probes))
if len(sys.argv) > 1:  # this agent also compresses its history before it ends with /complete
    client.chat.completions.create(model="x", messages=[messages[0], {"role": "user", "content": "Summary."}],
                                   max_tokens=8, temperature=1.0, seed=7)
    body = json.dumps({"reward_info": {"reward": float(sys.argv[1])}}).encode()
    urllib.request.urlopen(urllib.request.Request(os.environ["PRORL_SESSION_URL"] + "/complete", data=body,
                                                  headers={"Content-Type": "application/json"}))
    import time; time.sleep(3600)  # completion is the /complete call, not the exit
'''


@pytest.fixture
def registry():
    r = HandlerRegistry()
    r.register(CliAgentHandler)
    return r


@pytest.mark.real
async def test_agent_script_in_bubblewrap_is_trained_through_the_gateway(tap_llm,
        gateway_server, registry, bwrap_runtime, vllm_server, tokenizer, sandbox_procs):
    client, app = await gateway_server([vllm_server.address], registry=registry, runtime=bwrap_runtime)
    calls = tap_llm(app[GATEWAY])
    problem = humaneval_problems()["HumanEval/0"]
    solved = {**to_instance(problem), "data_source": "cli_agent", "command": "python3 agent.py",
              "files": {"agent.py": AGENT, "answer.txt": problem["prompt"] + problem["canonical_solution"]},
              "env": {"SERVER_PORT": str(client.port)}}
    wrong = {**solved, "instance_id": "wrong", "files": {**solved["files"], "answer.txt": problem["prompt"] + "    return True\n"}}
    by_complete = {"data_source": "cli_agent", "instance_id": "complete", "command": "python3 agent.py 0.75",
                   "files": solved["files"], "env": {"SERVER_PORT": str(client.port)}, "complete_grace_s": 0.5}

    results = []
    for inst in (solved, wrong, by_complete):
        r = await client.post("/process", json={"instance": inst, "timeout_s": 120}, headers=AUTH)
        results.append(await r.json())
    for res in results:
        assert res["critical_error"] is None, (res["error"], res["traceback"])
        g = res["extra"]["gateway"]
        assert g["state"] in ("finalized", "completed")
        if g["end_reason"] == "exit":  # it reached neither the server's API nor a session URL without the key
            assert 'PROBES {"server_status": "ConnectionRefusedError", "session_status": 403}' in g["output_tail"]
    (ok, bad, done) = results
    assert (ok["reward"], ok["resolved"]) == (1.0, True) and ok["extra"]["gateway"]["end_reason"] == "exit"
    assert ok["extra"]["gateway"]["exit_code"] == 0
    assert bad["reward"] == 0.0 and bad["extra"]["eval"]["failed_test"]
    assert done["reward"] == 0.75 and done["extra"]["gateway"]["end_reason"] == "complete"
    assert done["extra"]["gateway"]["reward_info"] == {"reward": 0.75}
    # every trajectory of the session is in the result: the compressing agent has two
    assert [len(r["trajectories"]) for r in results] == [1, 1, 2]
    assert [r["extra"]["gateway"]["counters"]["requests"] for r in results] == [2, 2, 3]
    assert done["extra"]["gateway"]["split_reasons"] == [done["trajectories"][0]["split_reason"]]
    assert done["trajectories"][0]["split_reason"] == "message_changed: message 1 was assistant, now user"

    # the tokens are exactly vLLM's, in calls order across the three jobs
    assert len(calls) == 7
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Write the function."}],
                                             tokenize=False, add_generation_prompt=True)
    for res, mine in zip(results, (calls[0:2], calls[2:4], calls[4:6])):
        traj = Trajectory(**res["trajectories"][0])
        generated = [t for t, m in zip(traj.response_ids, traj.loss_mask) if m]
        assert generated == [t for _, c in mine for t in c.token_ids]
        assert mine[1][0] == (traj.prompt_ids + traj.response_ids)[:len(mine[1][0])]
        assert traj.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
    last = Trajectory(**done["trajectories"][1])
    assert last.prompt_ids == calls[6][0] and last.response_ids == calls[6][1].token_ids
    assert not app[GATEWAY].open
    await bwrap_runtime.close_all()
    assert not sandbox_procs()


# ------------------------------------------------------------------------------------------ eval mode
CODE = {"prompt": "def f():\n", "tests": "def check(c): assert c() == 1\n", "entry_point": "f"}


@pytest.mark.parametrize("instance,default,mode", [
    (CODE, None, "code"),
    (CODE, "reward_info", "code"),                  # a handler default never beats the instance's tests
    ({**CODE, "eval": "reward_info"}, None, "reward_info"),  # asked for explicitly: the trusted-agent mode
    ({**CODE, "eval": "none"}, None, "none"),
    ({}, None, "reward_info"),                      # no tests: the agent's reward_info (trusted)
    ({}, "none", "none"),
])
def test_eval_mode_defaults_to_the_tests_an_instance_carries(instance, default, mode):
    assert _eval_mode(instance, default) == mode


@pytest.mark.parametrize("instance", [
    {"tests": CODE["tests"], "prompt": CODE["prompt"]},     # tests without entry_point
    {"tests": CODE["tests"], "entry_point": "f"},           # tests without prompt
    {"entry_point": "f"},
    {"FAIL_TO_PASS": ["t::test_a"]},                       # tests of another kind: still not reward_info
    {**CODE, "tests": ""},
    {"eval": "code"},
    {"eval": "exit_status"},
])
@pytest.mark.parametrize("default", [None, "reward_info"])
def test_an_instance_with_tests_never_falls_to_reward_info(instance, default):
    with pytest.raises(InvalidInstanceError, match="cli_agent"):
        _eval_mode(instance, default)


async def test_a_cli_agent_instance_with_tests_but_no_entry_point_is_refused_at_submit(gateway_server, registry):
    client, _ = await gateway_server(["http://127.0.0.1:9"], registry=registry)  # never reached
    inst = {"data_source": "cli_agent", "command": "true", "prompt": CODE["prompt"], "tests": CODE["tests"]}
    r = await client.post("/process", json={"instance": inst}, headers=AUTH)
    res = await r.json()
    # refused at submit by the handler's instance model, before any job (or sandbox) exists
    assert r.status == 422 and res["error"]["type"] == "validation_error", res
    assert "entry_point" in res["error"]["message"]


# ------------------------------------------------------------------------------------------ failures
LAUNCHER = Path(__file__).resolve().parents[2] / "handlers" / "cli_agent" / "launcher.py"


@pytest.mark.real
def test_launcher_exit_statuses_tell_its_own_failure_from_the_commands(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "gw.sock"))
    (tmp_path / "not_executable").write_text("#!/bin/sh\n")
    session_file = tmp_path / "session"
    session_file.write_text("/sessions/s.k")

    def launch(socket_path, *command):
        return subprocess.run([sys.executable, str(LAUNCHER), socket_path, str(session_file), "--", *command],
                              capture_output=True, text=True, timeout=60)

    missing_socket = launch(str(tmp_path / "none.sock"), "true")
    assert missing_socket.returncode == 125 and "prorl-launcher: no gateway socket" in missing_socket.stderr
    assert launch(str(tmp_path / "gw.sock")).returncode == 125  # no command
    assert launch(str(tmp_path / "gw.sock"), str(tmp_path / "no_such_agent")).returncode == 127
    assert launch(str(tmp_path / "gw.sock"), str(tmp_path / "not_executable")).returncode == 126
    assert launch(str(tmp_path / "gw.sock"), "sh", "-c", "exit 3").returncode == 3
    session_file.unlink()
    unreadable = launch(str(tmp_path / "gw.sock"), "true")
    assert unreadable.returncode == 125 and "cannot read the session file" in unreadable.stderr
    sock.close()


# An agent that asks the model once (its answer printed), then exits with the status it is given.
ASK = r'''
import json, os, sys, urllib.request
body = {"model": "x", "messages": [{"role": "user", "content": "Hello."}], "max_tokens": 4, "temperature": 1.0}
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
try:
    print("ANSWER", json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["message"]["content"])
except Exception as e:
    print("NO ANSWER", e)
sys.exit(int(sys.argv[1]))
'''


def _agent(command, **kw):
    return {"data_source": "cli_agent", "command": command, "eval": "none", "files": {"ask.py": ASK},
            "agent_timeout_s": 120, **kw}


@pytest.mark.real
async def test_a_missing_or_broken_agent_is_an_infrastructure_failure_not_a_zero_reward(
        gateway_server, registry, bwrap_runtime, vllm_server, sandbox_procs):
    client, _ = await gateway_server([vllm_server.address], registry=registry, runtime=bwrap_runtime)
    cases = {
        "missing": (_agent("no-such-agent --task 1"), "agent_missing", "command not found"),
        "not_executable": (_agent("./agent.sh", files={"agent.sh": "#!/bin/sh\necho hi\n"}), "agent_missing",
                           "Permission denied"),
        "crashed_before_asking": (_agent("python3 -c 'import no_such_module_for_the_agent'"), "harness",
                                  "ModuleNotFoundError"),
        # a present agent that asked the model and then exits 127 by itself: its outcome, scored normally
        "asked_then_127": (_agent("python3 ask.py 127"), None, "ANSWER"),
        "asked_then_1": (_agent("python3 ask.py 1"), None, "ANSWER"),
    }
    for name, (inst, kind, tail) in cases.items():
        r = await client.post("/process", json={"instance": inst, "timeout_s": 180}, headers=AUTH)
        res = await r.json()
        g = res["extra"].get("gateway") or {}
        assert tail in (g.get("output_tail") or ""), (name, res["error"], g)
        if kind is None:
            assert (res["critical_error"], res["failure_kind"], res["filter"]) == (None, None, False), (name, res)
            assert res["trajectories"] and g["exit_code"] in (127, 1)
        else:
            assert (res["critical_error"], res["failure_kind"], res["filter"]) == ("run", kind, True), (name, res)
            assert res["reward"] == 0.0 and g["counters"]["requests"] == 0
    await bwrap_runtime.close_all()
    assert not sandbox_procs()


@pytest.mark.real
async def test_an_agent_whose_llm_requests_all_fail_is_filtered_as_llm_backend(
        gateway_server, registry, bwrap_runtime, sandbox_procs):
    with socket.socket() as s:  # a port with nothing listening: the backend is down
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    client, _ = await gateway_server([dead], registry=registry, runtime=bwrap_runtime, backend_wait_s=1)
    for status in (0, 1):  # whether the agent swallows the error or fails on it, the model had no part
        r = await client.post("/process", json={"instance": _agent(f"python3 ask.py {status}"), "timeout_s": 180},
                              headers=AUTH)
        res = await r.json()
        assert (res["critical_error"], res["failure_kind"], res["filter"]) == ("run", "llm_backend", True), res
        assert "NO ANSWER" in res["extra"]["gateway"]["output_tail"]
    await bwrap_runtime.close_all()
    assert not sandbox_procs()


# ------------------------------------------------------------------------------------------ capabilities


def _all_cmdlines() -> dict[int, str]:
    import os

    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[int(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            pass
    return out


@pytest.mark.real
async def test_session_key_is_in_no_command_line_and_its_socket_is_private(gateway_server, registry,
                                                                          bwrap_runtime, sandbox_procs):
    """While an agent runs, its session key is in no process's command line (``ps`` shows those to every
    local user), and the socket, its directory and the session file are the sandbox user's alone. The agent
    never calls the model here, so the backend is an address nobody answers on."""
    import asyncio
    import os
    import stat

    from prorl_server.app import PIPELINE

    client, app = await gateway_server(["http://127.0.0.1:9"], registry=registry, runtime=bwrap_runtime)
    marker = "capability-test-agent"
    inst = {"data_source": "cli_agent", "eval": "none", "agent_timeout_s": 300,
            "command": f"test -n \"$OPENAI_API_KEY\" && exec -a {marker} sleep 300"}
    r = await client.post("/jobs", json={"instance": inst, "job_id": "cap"}, headers=AUTH)
    assert r.status == 202, await r.text()
    gw = app[GATEWAY]
    for _ in range(600):  # until the agent runs (the test's own bound: 60 s)
        if gw.open and any(marker in c for c in _all_cmdlines().values()):
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail(f"the agent never started: {await (await client.get('/jobs/cap', headers=AUTH)).text()}")
    (session,) = gw.open.values()
    leaks = {pid: c for pid, c in _all_cmdlines().items() if session.key in c}
    assert not leaks, leaks
    gw_dir = app[PIPELINE].get("cap").state.gateway_dir
    for path, mode in [(gw_dir, 0o700), (os.path.join(gw_dir, "gateway.sock"), 0o700),
                       (os.path.join(gw_dir, "session"), 0o600)]:
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == mode, (path, oct(st.st_mode))
    assert stat.S_ISSOCK(os.stat(os.path.join(gw_dir, "gateway.sock")).st_mode)
    r = await client.post("/cancel", json={"job_id": "cap"}, headers=AUTH)
    assert (await r.json())["cancelled"] is True
