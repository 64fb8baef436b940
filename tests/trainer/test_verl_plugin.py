"""The verl 0.9.1 adapter: the agent loop as verl instantiates and post-processes it, the shipped Hydra
configs, and verl's DAPO/CISPO losses on batches built from rollout-server trajectories."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verl")
import torch  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop import agent_loop as verl_agent_loop  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, DictConfigWrap, ToolListWrap  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_policy_loss_fn  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset  # noqa: E402
from verl.utils.import_utils import resolve_config_path  # noqa: E402

from trainer_plugins.verl.agent_loop import ProRLAgentLoop  # noqa: E402

PROMPT_LEN, RESPONSE_LEN = 64, 16


@pytest.fixture
def cfg(compose_verl):
    return compose_verl("prorl_dapo", prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN)


@pytest.fixture
def worker(cfg, tokenizer, monkeypatch):
    """verl's AgentLoopWorker without Ray, built the way verl's own CPU tests do (``object.__new__``), with
    the agent loop registry read from our YAML as ``AgentLoopWorker.__init__`` reads it."""
    w = object.__new__(AgentLoopWorker)
    w.config = cfg
    w.llm_client = None
    w.teacher_client = None
    w.reward_loop_worker_handles = None
    w.rollout_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    w.dataset_cls = RLHFDataset
    w.tokenizer = tokenizer
    w.processor = None
    w.hf_model_type = "qwen2"
    w.mm_processor_kwargs = {}
    w.distillation_enabled = False
    w.tools = []
    for entry in OmegaConf.load(resolve_config_path(w.rollout_config.agent.agent_loop_config_path)):
        monkeypatch.setitem(verl_agent_loop._agent_loop_registry, entry.name, entry)
    return w


def make_loop(cfg, tokenizer, **settings):
    """Instantiate the YAML entry exactly as ``AgentLoopWorker._run_agent_loop`` does."""
    entry = verl_agent_loop._agent_loop_registry["prorl"]
    return instantiate(config=entry, trainer_config=DictConfigWrap(config=cfg), server_manager=None,
                       tokenizer=tokenizer, processor=None, hf_model_type="qwen2", dataset_cls=RLHFDataset,
                       data_config=DictConfigWrap(cfg.data), tools=ToolListWrap([]), **settings)


def spy_on_submissions(monkeypatch, record):
    """Calls ``record(server, body)`` for every job the shared client (``trainer_plugins.jobs.JobSubmitter``)
    submits, before it is submitted."""
    from trainer_plugins.jobs import JobSubmitter

    real = JobSubmitter.submit

    async def submit(self, server, request, **kw):
        record(server, request.model_dump(exclude_none=True))
        return await real(self, server, request, **kw)

    monkeypatch.setattr(JobSubmitter, "submit", submit)


def fixed_row(prompt_ids, response_ids, reward=1.0, versions=(3, 4), sleep=0, mask=None):
    traj = {"prompt_ids": prompt_ids, "response_ids": response_ids,
            "response_logprobs": [-0.5 - 0.01 * i for i in range(len(response_ids))],
            "loss_mask": mask or [1] * len(response_ids), "weight_versions": list(versions)}
    return {"raw_prompt": np.array([{"role": "user", "content": "hi"}], dtype=object), "data_source": "fixed",
            "extra_info": {"index": 7, "instance": {"data_source": "fixed", "trajectory": traj,
                                                     "reward": reward, "sleep": sleep}},
            "index": 7}


def test_yaml_entry_instantiates_through_hydra(cfg, worker, tokenizer, monkeypatch):
    monkeypatch.setenv("PRORL_SERVERS", "http://127.0.0.1:1,http://127.0.0.1:2")
    loop = make_loop(cfg, tokenizer)
    assert isinstance(loop, ProRLAgentLoop)
    assert loop.servers == "http://127.0.0.1:1,http://127.0.0.1:2"
    assert (loop.prompt_length, loop.response_length) == (PROMPT_LEN, RESPONSE_LEN)
    from trainer_plugins.admission import LeastInFlight, RendezvousByGroup

    assert isinstance(loop.chooser, RendezvousByGroup)  # the YAML's server_chooser
    other = make_loop(cfg, tokenizer, server_chooser="least_in_flight")
    assert isinstance(other.chooser, LeastInFlight) and make_loop(cfg, tokenizer).chooser is loop.chooser
    with pytest.raises(Exception, match="server_chooser must be one of"):  # hydra wraps the ValueError
        make_loop(cfg, tokenizer, server_chooser="fastest")
    monkeypatch.delenv("PRORL_SERVERS")
    with pytest.raises(Exception, match="servers"):
        make_loop(cfg, tokenizer)


@pytest.mark.parametrize("name, loss_mode", [("prorl_dapo", "vanilla"), ("prorl_cispo", "cispo")])
def test_shipped_configs_compose_into_verl_dataclasses(compose_verl, name, loss_mode):
    c = compose_verl(name, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN)
    actor = omega_conf_to_dataclass(c.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode == loss_mode and actor.loss_agg_mode == "token-mean"
    if name == "prorl_dapo":
        assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)
    algo = omega_conf_to_dataclass(c.algorithm)
    assert algo.filter_groups.enable and algo.filter_groups.metric == "acc"
    assert c.algorithm.rollout_correction.rollout_is == "token"
    rollout = omega_conf_to_dataclass(c.actor_rollout_ref.rollout)
    assert rollout.agent.default_agent_loop == "prorl" and rollout.calculate_log_probs
    assert c.trainer.v1.trainer_mode == "colocate_async"
    assert c.trainer.v1.sampler.max_off_policy_threshold == 2  # async within a bound (#32 part 1)
    # the V1 sampler that drops groups with a filtered row, given DAPO's settings (verl passes it none)
    from trainer_plugins.verl.replay_buffer import ProRLReplayBuffer
    from verl.utils.import_utils import load_extern_type

    sampler = c.trainer.v1.sampler
    assert load_extern_type(sampler.custom_sampler.path, sampler.custom_sampler.name) is ProRLReplayBuffer
    assert (sampler.sampler_kwargs.filter_groups_enable, sampler.sampler_kwargs.filter_groups_metric) == (True, "acc")


async def test_output_is_truncated_and_carries_versions_and_reward_extras(cfg, worker, tokenizer,
                                                                         start_llm_server, monkeypatch):
    url = await start_llm_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    loop = make_loop(cfg, tokenizer)
    prompt, response = list(range(10, 10 + PROMPT_LEN + 5)), list(range(500, 500 + RESPONSE_LEN + 9))
    out = await loop.run({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True},
                         **fixed_row(prompt, response, reward=1.0, versions=(3, 4)))
    assert out.prompt_ids == prompt[-PROMPT_LEN:]  # left-truncated, as verl caps prompts
    assert out.response_ids == response[:RESPONSE_LEN]
    assert out.response_mask == [0] * RESPONSE_LEN  # cut: masked (truncation "mask", test_verl_truncation.py)
    assert out.response_logprobs == pytest.approx([-0.5 - 0.01 * i for i in range(RESPONSE_LEN)])
    assert out.reward_score == 1.0
    assert out.extra_fields["reward_extra_info"] == {"acc": 1.0, "score": 1.0}
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (3, 4)
    assert all(type(out.extra_fields[k]) is int for k in ("min_global_steps", "max_global_steps"))
    assert out.extra_fields["prorl"]["truncated"] == {"prompt": 5, "response": 9}


async def test_the_legacy_worker_gets_the_last_segment_of_a_split_rollout(cfg, worker, tokenizer,
                                                                         start_llm_server, monkeypatch):
    url = await start_llm_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    row = fixed_row([1, 2], [3, 4], versions=(2,))
    second = {"prompt_ids": [5, 6, 7], "response_ids": [8, 9], "response_logprobs": [-0.1, -0.2],
              "loss_mask": [1, 1], "weight_versions": [3]}
    row["extra_info"]["instance"]["trajectories"] = [row["extra_info"]["instance"]["trajectory"], second]
    out = await make_loop(cfg, tokenizer).run({}, **row)  # no session_id: verl's legacy AgentLoopWorker
    assert (out.prompt_ids, out.response_ids) == ([5, 6, 7], [8, 9])
    assert out.extra_fields["prorl"]["segments"] == 2 and out.extra_fields["min_global_steps"] == 3
    outs = await make_loop(cfg, tokenizer).run({}, **row, session_id=0)  # V1's AgentLoopWorkerTQ: all of them
    assert [o.response_ids for o in outs] == [[3, 4], [8, 9]] and [o.reward_score for o in outs] == [1.0, 1.0]


async def test_cancelling_the_loop_cancels_the_job_on_the_server(cfg, worker, tokenizer, start_llm_server,
                                                                monkeypatch, job_state):
    url = await start_llm_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    loop = make_loop(cfg, tokenizer)
    seen = []
    spy_on_submissions(monkeypatch, lambda server, body: seen.append(body["job_id"]))
    task = asyncio.create_task(loop.run({}, **fixed_row([1, 2], [3], sleep=30)))
    for _ in range(200):
        if seen and (await job_state(url, seen[0])).get("state") == "run":
            break
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        s = await job_state(url, seen[0])
        if s["state"] == "done":
            break
        await asyncio.sleep(0.02)
    assert s["state"] == "done" and s["result"]["critical_error"] == "cancelled"


async def test_request_timeout_cancels_each_attempt_and_yields_a_zero_loss_filtered_row(
        cfg, worker, tokenizer, start_llm_server, monkeypatch, job_state):
    url = await start_llm_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    loop = make_loop(cfg, tokenizer, request_timeout_s=0.5, max_sample_retries=1)
    out = await asyncio.wait_for(loop.run({}, **fixed_row([1, 2], [3], sleep=30), global_steps=5), 20)
    assert out.reward_score == 0.0 and out.prompt_ids
    # one untrained response token: verl writes the reward at the last response position
    assert out.response_ids == [tokenizer.eos_token_id] and out.response_mask == [0]
    assert out.extra_fields["min_global_steps"] == 5  # the server reported none: the trainer's step
    prorl = out.extra_fields["prorl"]
    assert prorl["filter"] is True and prorl["failure_kind"] == "timeout"
    assert [a["failure_kind"] for a in prorl["attempts"]] == ["timeout", "timeout"]
    for attempt in prorl["attempts"]:  # every attempt was cancelled on the server, none left running
        s = await job_state(url, attempt["job_id"])
        assert s["result"]["critical_error"] == "cancelled"


async def test_a_filtered_sample_is_resubmitted_and_the_retry_is_trained(cfg, worker, tokenizer, start_llm_server,
                                                                         monkeypatch, fixed, job_state):
    # the first job's sandbox dies (fault injection, see FixedTrajectoryHandler): the server answers
    # failure_kind="sandbox", filter: true; the plugin re-submits and returns the retry's trajectory
    url = await start_llm_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    loop = make_loop(cfg, tokenizer)
    row = fixed_row([1, 2, 3], [4, 5, 6], reward=1.0)
    row["extra_info"]["instance"].update(id="flaky", fail_first=1)
    out = await loop.run({}, **row)
    assert fixed.jobs["flaky"] == 2
    assert out.response_ids == [4, 5, 6] and out.response_mask == [1, 1, 1] and out.reward_score == 1.0
    prorl = out.extra_fields["prorl"]
    assert prorl["filter"] is False and prorl["failure_kind"] is None
    [attempt] = prorl["attempts"]
    assert attempt["failure_kind"] == "sandbox" and "died" in attempt["error"]
    first = (await job_state(url, attempt["job_id"]))["result"]
    assert first["filter"] is True and first["failure_kind"] == "sandbox"

    # a sample that fails every attempt: 1 + max_sample_retries jobs, then a filtered zero-loss row
    row["extra_info"]["instance"].update(id="dead", fail_first=99)
    out = await make_loop(cfg, tokenizer, max_sample_retries=1).run({}, **row)
    assert fixed.jobs["dead"] == 2
    assert out.extra_fields["prorl"]["filter"] is True and out.reward_score == 0.0
    assert out.response_mask == [0] and out.extra_fields["reward_extra_info"] == {"acc": 0.0, "score": 0.0}


async def test_an_unreachable_rollout_server_is_retried_on_another(cfg, worker, tokenizer, start_llm_server,
                                                                   monkeypatch, unused_tcp_port_factory):
    live, dead = await start_llm_server(), f"http://127.0.0.1:{unused_tcp_port_factory()}"
    monkeypatch.setenv("PRORL_SERVERS", f"{dead},{live}")
    loop = make_loop(cfg, tokenizer)
    from trainer_plugins.servers import server_for_group

    # a group whose server is the dead one
    uid = next(u for u in (f"g{k}" for k in range(100)) if server_for_group([dead, live], f"verl-{u}") == dead)
    out = await loop.run({}, **fixed_row([1, 2], [3, 4]), uid=uid)
    [attempt] = out.extra_fields["prorl"]["attempts"]
    assert attempt["server"] == dead and attempt["failure_kind"] == "rollout_server"
    assert out.response_ids == [3, 4] and out.extra_fields["prorl"]["filter"] is False


async def test_a_server_with_no_backend_yet_gets_the_row_again_when_one_is_registered(
        cfg, worker, tokenizer, start_llm_server, scripted_policy, monkeypatch):
    # a 503 (no LLM backend registered yet: the trainer is still starting its replicas) is offered again on
    # the same server, as the TRL plugin and RolloutClient do, not spent as a filtered attempt
    import aiohttp
    from aiohttp import web

    answered: list[tuple[str, int]] = []

    @web.middleware
    async def record(request, handler):
        try:
            resp = await handler(request)
        except web.HTTPException as e:
            answered.append((request.path, e.status))
            raise
        answered.append((request.path, resp.status))
        return resp

    url = await start_llm_server(middlewares=[record])  # no backend
    monkeypatch.setenv("PRORL_SERVERS", url)
    loop = make_loop(cfg, tokenizer, max_sample_retries=0)  # a filtered attempt would end the row filtered
    row = {"raw_prompt": [{"role": "user", "content": "Compute 2+3."}], "data_source": "chat",
           "reward_model": {"ground_truth": "5"}, "extra_info": {"index": 1}}
    task = asyncio.ensure_future(loop.run({}, **row))
    for _ in range(1500):
        if ("/process", 503) in answered or task.done():
            break
        await asyncio.sleep(0.02)
    assert ("/process", 503) in answered and not task.done()
    llm = await scripted_policy(lambda prompt, turn: "\\boxed{5}")
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/add_llm_server", json={"address": llm}) as r:
            assert r.status == 200
    out = await asyncio.wait_for(task, 60)
    assert out.extra_fields["prorl"]["filter"] is False and out.extra_fields["prorl"]["attempts"] == []
    assert out.reward_score == 1.0 and sum(out.response_mask) > 0


async def test_a_refused_token_is_a_rollout_auth_error(cfg, worker, tokenizer, start_llm_server, monkeypatch):
    from trainer_plugins.jobs import RolloutAuthError

    url = await start_llm_server(token="s3cret")
    monkeypatch.setenv("PRORL_SERVERS", url)
    with pytest.raises(RolloutAuthError, match=r"401.*PRORL_TOKEN"):
        await make_loop(cfg, tokenizer, token="wrong").run({}, **fixed_row([1, 2], [3]))
    with pytest.raises(RuntimeError):  # what callers of the old verl loop caught still catches it
        await make_loop(cfg, tokenizer).run({}, **fixed_row([1, 2], [3]))
    out = await make_loop(cfg, tokenizer, token="s3cret").run({}, **fixed_row([1, 2], [3]))
    assert out.response_ids == [3] and out.extra_fields["prorl"]["filter"] is False


async def test_the_loops_of_a_worker_share_one_client_and_session(cfg, worker, tokenizer, start_llm_server,
                                                                   monkeypatch):
    url = await start_llm_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    a, b = make_loop(cfg, tokenizer), make_loop(cfg, tokenizer)
    await asyncio.gather(a.run({}, **fixed_row([1], [2])), b.run({}, **fixed_row([1], [2])))
    urls, headers = await a._servers()
    assert a._jobs(headers) is b._jobs(headers)  # one aiohttp session per event loop, not one per request
    assert make_loop(cfg, tokenizer, request_timeout_s=5)._jobs(headers) is not a._jobs(headers)
    await a._jobs(headers).close()


async def test_the_samples_of_a_group_go_to_one_server_with_the_group_id(cfg, worker, tokenizer, start_llm_server,
                                                                        monkeypatch):
    urls = [await start_llm_server(), await start_llm_server()]
    monkeypatch.setenv("PRORL_SERVERS", ",".join(urls))
    loop = make_loop(cfg, tokenizer)
    sent = []
    spy_on_submissions(monkeypatch, lambda server, body: sent.append((body["instance"]["row"], server,
                                                                      body.get("group_id"))))
    uids = [f"prompt-{k}" for k in range(8)]
    rows = []
    for u in uids:
        for _ in range(4):
            row = fixed_row([1, 2], [3])
            row["extra_info"]["instance"]["row"] = u  # which row a submission came from, seen by the spy
            rows.append((u, row))
    await asyncio.gather(*(loop.run({}, **row, uid=u) for u, row in rows))
    assert len(sent) == len(rows)
    by_uid = {u: {(url, gid) for uid, url, gid in sent if uid == u} for u in uids}
    assert all(len(v) == 1 for v in by_uid.values())  # all 4 samples of a prompt: one server, one group_id
    assert {gid for v in by_uid.values() for _, gid in v} == {f"verl-{u}" for u in uids}
    assert {url for v in by_uid.values() for url, _ in v} == set(urls)  # groups spread over the servers


# ---------------------------------------------------------------------------------------- default row mapping
def verl_rows():
    """Rows as verl's preprocessing scripts write them: gsm8k (examples/data_preprocess/gsm8k.py: the prompt
    with an instruction appended, ground truth in reward_model, the raw question and worked solution in
    extra_info), a MATH row (no extra_info.question), and HumanEval with its problem fields in extra_info."""
    from handlers.code.data import humaneval_problems

    he = humaneval_problems()["HumanEval/2"]
    return {
        "gsm8k": {"data_source": "openai/gsm8k",
                  "raw_prompt": np.array([{"role": "user", "content": "What is 6 * 12? Let's think step by step "
                                           "and output the final answer after \"####\"."}], dtype=object),
                  "reward_model": {"style": "rule", "ground_truth": "72"},
                  "extra_info": {"split": "train", "index": 3, "question": "What is 6 * 12?",
                                 "answer": "6 * 12 = 72\n#### 72"}},
        "math": {"data_source": "lighteval/MATH",
                 "raw_prompt": [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Compute 2+3."}],
                 "reward_model": {"ground_truth": "5"}, "extra_info": {"index": 4}},
        "code": {"data_source": "code",
                 "raw_prompt": [{"role": "user", "content": "Complete truncate_number."}],
                 "reward_model": {"ground_truth": None},
                 "extra_info": {"index": 5, "prompt": he["prompt"], "tests": he["test"],
                                "entry_point": he["entry_point"]}},
    }


def test_default_row_mapping_fills_the_math_and_code_fields(cfg, worker, tokenizer, monkeypatch):
    monkeypatch.setenv("PRORL_SERVERS", "http://127.0.0.1:1")
    loop = make_loop(cfg, tokenizer)
    r = verl_rows()
    gsm = loop.build_instance(r["gsm8k"])
    assert (gsm["data_source"], gsm["question"], gsm["answer"], gsm["instance_id"]) == \
        ("math", "What is 6 * 12?", "72", "3")  # ground truth over extra_info's worked solution
    assert "split" not in gsm and gsm["messages"][0]["role"] == "user"
    math = loop.build_instance(r["math"])
    assert (math["data_source"], math["question"], math["answer"]) == ("math", "Compute 2+3.", "5")
    code = loop.build_instance(r["code"])
    assert code["data_source"] == "code" and code["entry_point"] == "truncate_number"
    from handlers.code.data import validate_instance

    validate_instance(code)
    from trainer_plugins.verl.agent_loop import InvalidRowError

    with pytest.raises(InvalidRowError, match="index"):
        loop.build_instance({"raw_prompt": [{"role": "user", "content": "x"}], "extra_info": {"index": 9}})


class UnstartableRuntime:
    """Stands for a node whose sandboxes cannot start (``SandboxStartError`` on every start): a job whose
    instance passed its handler's validation (which the shipped handlers do before opening a sandbox) then
    fails with ``failure_kind="sandbox"``, one that did not with ``invalid_instance``."""

    async def start(self, spec):
        from sandbox.errors import SandboxStartError

        raise SandboxStartError("injected: no sandbox can start here")

    async def close_all(self):
        pass


async def test_default_row_mapping_is_accepted_by_the_real_math_and_code_handlers(
        cfg, worker, tokenizer, serve_handlers, scripted_policy, monkeypatch):
    from handlers.code import CodeHandler
    from handlers.math import MathHandler
    from trainer_plugins.verl.agent_loop import InvalidRowError

    llm = await scripted_policy(lambda prompt, turn: "unused")
    url = await serve_handlers(MathHandler, CodeHandler, backends=[llm], sandbox_runtime=UnstartableRuntime())
    monkeypatch.setenv("PRORL_SERVERS", url)
    loop = make_loop(cfg, tokenizer, max_sample_retries=0)
    for name, row in verl_rows().items():
        out = await loop.run({}, **row)
        assert out.extra_fields["prorl"]["failure_kind"] == "sandbox", (name, out.extra_fields["prorl"])

    bad = verl_rows()["code"]
    del bad["extra_info"]["tests"]  # a code row with no tests: no valid instance
    # the server checks the instance against the handler's instance model at submit: a 422 naming the field
    with pytest.raises(InvalidRowError, match=r"data_source='code', index=5.*HTTP 422 instance\.tests"):
        await loop.run({}, **bad)
    bad = verl_rows()["math"]
    bad["reward_model"] = {}  # a math row with no answer
    with pytest.raises(InvalidRowError, match=r"lighteval/MATH.*answer"):
        await loop.run({}, **bad)


@pytest.mark.real
async def test_verl_rows_solve_real_math_and_code_jobs_through_the_default_mapping(
        compose_verl, worker, tokenizer, serve_handlers, scripted_policy, bwrap_runtime, sandbox_procs, monkeypatch):
    # verl-shaped rows (gsm8k, MATH, HumanEval) -> the default mapping -> real math and code handlers in
    # bubblewrap sandboxes, answered by the scripted policy (a test double standing for a capable model)
    from handlers.code import CodeHandler
    from handlers.code.data import humaneval_problems
    from handlers.math import MathHandler

    he = humaneval_problems()["HumanEval/2"]

    def script(prompt: str, turn: int) -> str:
        if "truncate_number" in prompt:
            call = {"name": "bash", "arguments": {
                "command": f"cat > solution.py <<'EOF'\n{he['prompt'] + he['canonical_solution']}\nEOF"}}
            if turn > 0:
                call = {"name": "finish", "arguments": {"answer": "done"}}
        else:
            # each in its dataset's format: gsm8k's "#### 72" (verl's gsm8k scorer), MATH's \boxed{}
            call = {"name": "finish", "arguments": {"answer": "#### 72" if "6 * 12" in prompt else "\\boxed{5}"}}
        return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"

    llm = await scripted_policy(script)
    url = await serve_handlers(MathHandler, CodeHandler, backends=[llm], sandbox_runtime=bwrap_runtime)
    monkeypatch.setenv("PRORL_SERVERS", url)
    # rollout lengths that hold these episodes (a longer one would be masked: truncation, test_verl_truncation.py)
    cfg = compose_verl("prorl_dapo", prompt_length=2048, response_length=2048)
    loop = make_loop(cfg, tokenizer, max_tokens=1024)
    outs = {name: await loop.run({}, **row) for name, row in verl_rows().items()}
    for name, out in outs.items():
        assert out.reward_score == 1.0, (name, out.extra_fields["prorl"])
        assert out.extra_fields["reward_extra_info"]["acc"] == 1.0 and sum(out.response_mask) > 0
    await bwrap_runtime.close_all()
    assert not sandbox_procs()


def loss_batch(data: DataProto, rewards: list[float]):
    """Advantages (GRPO, verl's estimator) for ``data``'s rows with the given outcome rewards."""
    mask = data.batch["response_mask"].float()
    last = mask.sum(-1).long().clamp(min=1) - 1
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(rewards)), last] = torch.tensor(rewards)
    adv, _ = compute_grpo_outcome_advantage(token_rewards, mask, np.zeros(len(rewards), dtype=object))
    return adv, mask


def policy_log_probs(model, data: DataProto) -> torch.Tensor:
    """Current-policy log-probs of the response tokens (the actor's forward pass, done here with HF)."""
    input_ids, attn = data.batch["input_ids"], data.batch["attention_mask"]
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=data.batch["position_ids"]).logits
    r = data.batch["responses"].shape[1]
    logp = torch.log_softmax(logits[:, -r - 1:-1].float(), dim=-1)
    return logp.gather(-1, data.batch["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)


@pytest.mark.parametrize("name", ["prorl_dapo", "prorl_cispo"])
async def test_verl_losses_run_on_a_batch_from_our_trajectories(name, compose_verl, tokenizer, worker,
                                                               start_llm_server, monkeypatch, hf_model):
    url = await start_llm_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    c = compose_verl(name, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN)
    worker.config = c
    rows = [fixed_row(list(range(20, 40)), list(range(100 + k, 110 + k)), mask=[1] * 8 + [0, 1])
            for k in range(4)]
    batch = DataProto.from_single_dict({k: np.array([r[k] for r in rows], dtype=object)
                                        for k in ("raw_prompt", "data_source", "extra_info", "index")})
    batch.non_tensor_batch["agent_name"] = np.array(["prorl"] * 4, dtype=object)
    data = await worker.generate_sequences(batch)
    adv, mask = loss_batch(data, [1.0, 0.0, 1.0, 0.0])
    actor = omega_conf_to_dataclass(c.actor_rollout_ref.actor)
    log_prob = policy_log_probs(hf_model, data)
    loss, metrics = get_policy_loss_fn(actor.policy_loss.loss_mode)(
        old_log_prob=data.batch["rollout_log_probs"], log_prob=log_prob, advantages=adv, response_mask=mask,
        loss_agg_mode=actor.loss_agg_mode, config=actor)
    assert torch.isfinite(loss)
    hf_model.zero_grad()
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in hf_model.parameters())
    assert "actor/pg_clipfrac" in metrics


@pytest.mark.real
async def test_real_llm_rows_pass_through_verls_post_processing(worker, tokenizer, start_llm_server,
                                                               vllm_server, monkeypatch, hf_model):
    url = await start_llm_server([vllm_server.address])
    monkeypatch.setenv("PRORL_SERVERS", url)
    prompts = [[{"role": "user", "content": f"What is {k} + {k}? Answer in \\boxed{{}}."}] for k in range(2)]
    n = 2  # a GRPO group of two samples per prompt
    raw = [p for p in prompts for _ in range(n)]
    batch = DataProto.from_single_dict({
        "raw_prompt": np.array([np.array(p, dtype=object) for p in raw] + [None], dtype=object)[:-1],
        "data_source": np.array(["chat"] * len(raw), dtype=object),
        "reward_model": np.array([{"ground_truth": str(2 * k)} for k in range(2) for _ in range(n)], dtype=object),
        "index": np.array([k for k in range(2) for _ in range(n)], dtype=object),
        "global_steps": np.array([0] * len(raw), dtype=object),
    })
    batch.non_tensor_batch["agent_name"] = np.array(["prorl"] * len(raw), dtype=object)
    data = await worker.generate_sequences(batch)

    b, nt = data.batch, data.non_tensor_batch
    assert b["responses"].shape == (4, RESPONSE_LEN) and b["prompts"].shape == (4, PROMPT_LEN)
    assert "rollout_log_probs" in b.keys() and "rm_scores" in b.keys()
    assert set(data.meta_info["reward_extra_keys"]) == {"acc", "score"}
    assert list(nt["acc"]) == [0.0] * 4  # a random model does not solve arithmetic
    assert all(type(v) is int for v in nt["min_global_steps"]) and list(nt["max_global_steps"]) == [0] * 4
    mask = b["response_mask"].bool()
    assert mask.any(axis=1).all()  # every row generated tokens
    lp = b["rollout_log_probs"]
    assert (lp[mask] < 0).all() and (lp[~mask] == 0).all()
    # the server's logprobs are the policy's: verl's tensors line up with a forward pass over them
    with torch.no_grad():
        ours = policy_log_probs(hf_model, data)
    assert torch.allclose(ours[mask], lp[mask], atol=2e-3)


def test_verls_top_level_tests_package_cannot_shadow_ours():
    # verl's wheel installs site-packages/tests; ours stays a plain folder collected by path (importlib mode)
    root = Path(__file__).resolve().parents[2]
    assert Path(__file__).resolve().parent == root / "tests" / "trainer"
    assert not list((root / "tests").rglob("__init__.py"))
