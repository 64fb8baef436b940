"""The ``cli_agent`` handler end to end: a small agent script using the real ``openai`` SDK runs inside a real
bubblewrap sandbox (no network), reaches its gateway session through the bound Unix socket, talks to the real
vLLM server, and its job result holds the trajectory of exactly vLLM's tokens and the reward of the code
handler's hidden tests, or the ``reward_info`` it posted with ``/complete``."""
from __future__ import annotations

import sys

import pytest

from handlers.cli_agent import CliAgentHandler
from handlers.code.data import humaneval_problems, to_instance
from handlers.registry import HandlerRegistry
from prorl_server.gateway import GATEWAY
from prorl_server.types import Trajectory

pytestmark = pytest.mark.real

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


async def test_agent_script_in_bubblewrap_is_trained_through_the_gateway(tap_llm,
        gateway_server, registry, bwrap_runtime, vllm_server, tokenizer, sandbox_procs):
    client, app = await gateway_server([vllm_server.address], registry=registry, runtime=bwrap_runtime)
    calls = tap_llm(app[GATEWAY])
    problem = humaneval_problems()["HumanEval/0"]
    solved = {**to_instance(problem), "data_source": "cli_agent", "command": f"{sys.executable} agent.py",
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
