"""TRL rollout function (trainer_plugins/trl/rollout.py) and the shared submit/cancel/retry rules
(trainer_plugins/jobs.py) against real rollout servers (the project's aiohttp app on loopback) serving the
``fixed`` test-double handler (tests/trainer/conftest.py: it returns the exact trajectory its instance gives,
and can fail its first jobs with a dead sandbox).

``trainer`` below is a stand-in for ``trl.GRPOTrainer``: only the attributes the rollout function reads
(``num_generations``, ``state.global_step``, ``args.temperature/top_p/top_k/max_completion_length``,
``processing_class.eos_token_id``); the real trainer runs in tests/trainer/test_trl_learning.py.

``ProRLRollout`` is synchronous (TRL calls it so) and runs its own event loop thread; the tests call it with
``asyncio.to_thread`` so the in-process servers on the test's loop keep answering.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest

from trainer_plugins.jobs import InvalidInstanceError, JobSubmitter, RolloutAuthError, process_request
from trainer_plugins.trl import ProRLRollout, UnknownPromptError, server_reward

EOS = 7


def make_trainer(num_generations: int, step: int = 0, temperature: float = 1.0, tokenizer=None):
    """Stand-in for ``trl.GRPOTrainer`` (see the module docstring); ``tokenizer``: the real one, when a test
    needs the chat template."""
    return SimpleNamespace(num_generations=num_generations, temperature=temperature,
                           state=SimpleNamespace(global_step=step),
                           args=SimpleNamespace(temperature=temperature, top_p=1.0, top_k=None,
                                                max_completion_length=12),
                           processing_class=tokenizer or SimpleNamespace(eos_token_id=EOS, pad_token_id=0))


def traj(prompt, turn1, env, turn2, version=0):
    """A two-turn trajectory: model tokens, an environment message (mask 0, logprob 0), model tokens."""
    return {"prompt_ids": prompt, "response_ids": turn1 + env + turn2,
            "response_logprobs": [-0.5] * len(turn1) + [0.0] * len(env) + [-0.25] * len(turn2),
            "loss_mask": [1] * len(turn1) + [0] * len(env) + [1] * len(turn2), "weight_versions": [version],
            "num_turns": 2}


def fixed_instance(name, rewards=(0.0, 1.0), **kw):
    return {"data_source": "fixed", "id": name, "prompt": f"say {name}", "rewards": list(rewards),
            "trajectory": traj([1, 2, 3], [10, 11], [20, 21, 22], [12, 13]), **kw}


async def call(rollout, prompts, trainer):
    return await asyncio.to_thread(rollout, prompts, trainer)


async def test_rows_are_the_servers_exact_tokens_with_the_loss_mask_as_env_mask(start_llm_server):
    url = await start_llm_server()
    instances = [fixed_instance("a"), fixed_instance("b", rewards=(0.25, 0.75))]
    rollout = ProRLRollout([url], instances, max_sample_retries=0)
    try:
        out = await call(rollout, ["say a", "say a", "say b", "say b"], make_trainer(2))
    finally:
        rollout.close()
    assert out["prompt_ids"] == [[1, 2, 3]] * 4
    assert out["completion_ids"] == [[10, 11, 20, 21, 22, 12, 13]] * 4
    assert out["env_mask"] == [[1, 1, 0, 0, 0, 1, 1]] * 4
    assert out["logprobs"] == [[-0.5, -0.5, 0.0, 0.0, 0.0, -0.25, -0.25]] * 4
    assert sorted(out["prorl_reward"][:2]) == [0.0, 1.0] and sorted(out["prorl_reward"][2:]) == [0.25, 0.75]
    assert out["prorl_weight_versions"] == [[0]] * 4
    assert out["prorl_filtered"] == [False] * 4
    # the reward function hands TRL the server's reward
    assert server_reward(["p"] * 4, ["c"] * 4, **{k: v for k, v in out.items() if k.startswith("prorl")}) == \
        out["prorl_reward"]
    stats = rollout.history[-1]
    assert stats.tokens_generated == 4 * 4 and stats.filtered_rows == 0 and stats.versions == [0]


async def test_a_groups_samples_share_a_group_id_and_a_server(start_llm_server):
    urls = [await start_llm_server(), await start_llm_server()]
    seen: dict[str, list] = {}
    instances = [fixed_instance(n) for n in "abcd"]
    rollout = ProRLRollout(urls, instances, max_sample_retries=0)
    try:
        prompts = [f"say {n}" for n in "abcd" for _ in range(3)]
        await call(rollout, prompts, make_trainer(3))
        async with aiohttp.ClientSession() as s:
            for u in urls:
                async with s.get(f"{u}/metrics") as r:
                    seen[u] = [line for line in (await r.text()).splitlines()
                               if line.startswith("prorl_jobs_total{") and 'handler="fixed"' in line]
    finally:
        rollout.close()
    # 4 groups of 3 over 2 servers: whole groups, 2 per server (6 jobs each)
    for u in urls:
        assert sum(float(line.rsplit(" ", 1)[1]) for line in seen[u]) == 6.0, seen


async def test_a_filtered_sample_is_resubmitted_and_its_retry_is_trained_on(start_llm_server, fixed):
    url = await start_llm_server()
    rollout = ProRLRollout([url], [fixed_instance("a", fail_first=1)], max_sample_retries=2)
    try:
        out = await call(rollout, ["say a", "say a"], make_trainer(2))
    finally:
        rollout.close()
    assert fixed.jobs["a"] == 3  # one dead sandbox, then two good jobs
    assert out["prorl_filtered"] == [False, False]
    assert out["env_mask"] == [[1, 1, 0, 0, 0, 1, 1]] * 2
    stats = rollout.history[-1]
    assert stats.retries == 1 and stats.failure_kinds == {"sandbox": 1}


async def test_a_sample_still_filtered_after_its_retries_is_a_row_trl_cannot_learn_from(start_llm_server, fixed):
    url = await start_llm_server()
    rollout = ProRLRollout([url], [fixed_instance("a", fail_first=3, rewards=(1.0,))], max_sample_retries=1)
    try:
        out = await call(rollout, ["say a", "say a"], make_trainer(2))
    finally:
        rollout.close()
    filtered = [i for i, f in enumerate(out["prorl_filtered"]) if f]
    assert len(filtered) == 1, out["prorl_filtered"]  # 3 dead sandboxes: one sample used both its attempts
    i, ok = filtered[0], 1 - filtered[0]
    assert out["completion_ids"][i] == [EOS] and out["env_mask"][i] == [0] and out["logprobs"][i] == [0.0]
    assert out["prompt_ids"][i] == out["prompt_ids"][ok] == [1, 2, 3]  # a sibling's exact prompt tokens
    assert out["prorl_reward"][i] is None and out["prorl_reward"][ok] == 1.0  # None: out of the group baseline
    assert out["prorl_failure_kind"][i] == "sandbox"
    assert server_reward([], [], prorl_reward=out["prorl_reward"]) == out["prorl_reward"]


async def test_a_prompt_with_no_instance_is_an_error_naming_it_before_any_job_runs(start_llm_server, fixed):
    url = await start_llm_server()
    rollout = ProRLRollout([url], [fixed_instance("a")])
    try:
        with pytest.raises(UnknownPromptError, match="say zebra"):
            await call(rollout, ["say a", "say zebra"], make_trainer(1))
    finally:
        rollout.close()
    assert sum(fixed.jobs.values()) == 0


async def test_a_prompt_the_handler_refuses_is_an_error_naming_the_prompt(start_server):
    url = await start_server()  # the arithmetic handler: a non-string expression fails its init
    instances = {"two plus two": {"data_source": "arithmetic", "expression": "2 + 2", "answer": 4},
                 "broken": {"data_source": "arithmetic", "expression": 4}}
    rollout = ProRLRollout([url], instances)
    try:
        with pytest.raises(InvalidInstanceError, match=r"prompt 'broken'.*HTTP 422 instance\.expression"):
            await call(rollout, ["two plus two", "broken"], make_trainer(1))
        # an unknown handler is the server's 400: the same error, naming the prompt
        rollout2 = ProRLRollout([url], {"x": {"data_source": "no_such_handler"}})
        with pytest.raises(InvalidInstanceError, match=r"prompt 'x'.*no_such_handler"):
            await call(rollout2, ["x"], make_trainer(1))
        rollout2.close()
    finally:
        rollout.close()


async def test_temperature_and_max_tokens_follow_the_trainer(start_llm_server, fixed, monkeypatch):
    url = await start_llm_server()
    sent = []
    orig = JobSubmitter.submit

    async def spy(self, server, request, **kw):
        sent.append(request.sampling_params)
        return await orig(self, server, request, **kw)

    monkeypatch.setattr(JobSubmitter, "submit", spy)
    rollout = ProRLRollout([url], [fixed_instance("a")], max_tokens=5)
    try:
        await call(rollout, ["say a"], make_trainer(1, temperature=0.7))
    finally:
        rollout.close()
    assert sent == [{"temperature": 0.7, "max_tokens": 5}]


# ------------------------------------------------------------------ a rollout server that dies mid-step
class DyingServer:
    """Stands in for a rollout server process killed while it runs jobs: it accepts connections and reads the
    ``/process`` requests (anything else is answered 404), then, once told to die, resets every connection (what the kernel does to a killed process's
    sockets) and refuses new ones. ``arrived`` counts the requests it read."""

    def __init__(self) -> None:
        self.arrived = 0
        self.die = asyncio.Event()
        self.server = None

    async def start(self) -> str:
        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"POST /process"):  # GET /tokenizer: answered as a server without it
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                writer.close()
                return
            self.arrived += 1
            await self.die.wait()
            writer.transport.abort()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def kill(self) -> None:
        self.server.close()  # no new connection is accepted
        self.die.set()


async def wait_for(cond, timeout_s=30.0):
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_a_server_that_dies_mid_step_gives_its_jobs_back_to_another_server(start_llm_server, fixed):
    dying = DyingServer()
    dead_url = await dying.start()
    live_url = await start_llm_server()
    rollout = ProRLRollout([dead_url, live_url], [fixed_instance(n) for n in "ab"], max_sample_retries=1)
    try:
        step = asyncio.ensure_future(call(rollout, ["say a", "say a", "say b", "say b"], make_trainer(2)))
        await wait_for(lambda: dying.arrived == 2)  # group a is on the dying server, mid-request
        await dying.kill()
        out = await asyncio.wait_for(step, 60)
    finally:
        rollout.close()
    assert out["prorl_filtered"] == [False] * 4
    assert out["env_mask"] == [[1, 1, 0, 0, 0, 1, 1]] * 4
    stats = rollout.history[-1]
    assert stats.retries == 2 and stats.failure_kinds == {"rollout_server": 2}


async def test_a_server_that_dies_with_no_other_left_ends_the_step_with_filtered_rows(tokenizer):
    dying = DyingServer()
    url = await dying.start()
    rollout = ProRLRollout([url], [fixed_instance("a")], max_sample_retries=2)
    try:
        step = asyncio.ensure_future(call(rollout, ["say a", "say a"], make_trainer(2, tokenizer=tokenizer)))
        await wait_for(lambda: dying.arrived == 2)
        await dying.kill()
        out = await asyncio.wait_for(step, 60)  # never a hung step
    finally:
        rollout.close()
    assert out["prorl_filtered"] == [True, True]
    assert out["prorl_failure_kind"] == ["rollout_server"] * 2
    assert out["prorl_reward"] == [None, None] and out["env_mask"] == [[0], [0]]
    # no sibling to take prompt tokens from: the trainer's own chat template renders the prompt
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "say a"}], tokenize=False,
                                             add_generation_prompt=True)
    assert out["prompt_ids"] == [tokenizer.encode(rendered, add_special_tokens=False)] * 2
    assert out["completion_ids"] == [[tokenizer.eos_token_id]] * 2


# ------------------------------------------------------------------ the shared submit rules
async def test_submit_rules_refused_token_timeout_and_caller_cancel(start_llm_server, fixed, job_state):
    url = await start_llm_server(token="s3cret")
    body = process_request(fixed_instance("a", sleep=30), job_id="t-1")
    async with JobSubmitter({"Authorization": "Bearer wrong"}) as jobs:
        with pytest.raises(RolloutAuthError, match="401"):
            await jobs.submit(url, body)
    headers = {"Authorization": "Bearer s3cret"}
    async with JobSubmitter(headers, request_timeout_s=0.5) as jobs:
        r = await jobs.submit(url, body)
        assert r.filter is True and r.failure_kind == "timeout"
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.get(f"{url}/jobs/t-1") as resp:
            state = await resp.json()
    assert state["state"] == "done" and state["result"]["critical_error"] == "cancelled"  # cancelled, not left running
    async with JobSubmitter(headers) as jobs:
        task = asyncio.ensure_future(jobs.submit(url, body.model_copy(update={"job_id": "t-2"})))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.get(f"{url}/jobs/t-2") as resp:
            assert (await resp.json())["result"]["critical_error"] == "cancelled"
