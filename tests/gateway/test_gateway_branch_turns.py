"""Turn records of gateway requests with ``n > 1`` (issue #35 part 1): every branch trajectory (its base's turns
plus the choice not continued) carries one record per turn whose spans tile its sampled tokens, and the continued
choice's turn is timed like an ``n = 1`` turn (its generation in ``t_llm_s``, the agent program's time until its
next request in ``t_tool_s``).

Fast tier: the backend is the scripted policy of tests/conftest.py (a labelled test double standing in for vLLM's
token-in/token-out ``/v1/completions``); the agent program is the real ``openai`` SDK over HTTP.
"""
from __future__ import annotations

import asyncio
import itertools

from prorl_server.types import Trajectory, TurnRecord
from tests.core.test_turn_records import assert_turns_tile

AUTH = {"Authorization": "Bearer server-secret"}  # the gateway_server fixture's token


def tiles(trajectories: list[Trajectory], turns: list[TurnRecord]) -> None:
    """The spans of ``turns`` tile each trajectory's ``loss_mask`` 1 positions exactly, in order, and there is
    one record per turn of every trajectory (:func:`assert_turns_tile`); every turn ended by a stop."""
    assert_turns_tile(trajectories, turns)
    assert all(t.finish_reason == "stop" for t in turns)


async def test_n_choices_branches_carry_turn_records_and_the_continued_turn_is_timed_like_n_1(
        gateway_server, open_session, scripted_policy):
    counter = itertools.count()

    def script(prompt: str, turn: int) -> str:  # distinct choices; turn 2 holds a tool call that does not parse
        k = next(counter)
        return f'v{k} <tool_call>\n{{"name": "x", "arguments": {{bad}}\n</tool_call>' if turn == 2 else f"v{k}"

    client, app = await gateway_server([await scripted_policy(script)])
    s, sdk = await open_session(client)
    tools = [{"type": "function", "function": {"name": "x", "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "Hi."}]
    # turn 0: n=3, the agent goes on with choice 1; turn 1: n=1; turn 2: n=2, it goes on with choice 0
    sleeps = {0: 0.05, 1: 0.01, 2: 0.3}
    for turn, (n, pick) in enumerate([(3, 1), (1, 0), (2, 0), (1, 0)]):
        r = await sdk.chat.completions.create(model="m", messages=messages, n=n, tools=tools)
        assert len(r.choices) == n
        await asyncio.sleep(sleeps.get(turn, 0.0))  # the agent program's own time after the answer
        m = r.choices[pick].message
        messages += [{"role": "assistant", "content": m.content, **({"tool_calls": [c.model_dump() for c in
                                                                                     m.tool_calls]}
                                                                    if m.tool_calls else {})},
                     {"role": "user", "content": f"more {turn}"}]
    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
    trajectories = [Trajectory(**t) for t in result["trajectories"]]
    turns = [TurnRecord(**t) for t in result["turns"]]
    # two branches of turn 0 (one turn each), one of turn 2 (three turns: its base's two and the choice), main
    assert [t.num_turns for t in trajectories] == [1, 1, 3, 4]
    assert [t.split_reason is not None and t.split_reason.startswith("branch") for t in trajectories] == [
        True, True, True, False]
    tiles(trajectories, turns)
    main = [t for t in turns if t.trajectory_index == 3]
    branch2 = [t for t in turns if t.trajectory_index == 2]
    # the continued choices' turns: generation, then the agent's time until its next request as tool time
    assert all(t.t_llm_s > 0 for t in main)
    assert main[0].t_tool_s >= sleeps[0] and main[2].t_tool_s >= sleeps[2]
    # the n=1 turn before the n=2 request is charged its own agent time only, not the next request's
    assert sleeps[1] <= main[1].t_tool_s < sleeps[2]
    # a branch's copies of its base's turns and its own choice carry no time (the request's wall time is the
    # continued turn's: summing every record still gives the session's time once)
    assert all(t.t_llm_s == t.t_tool_s == t.t_wait_s == 0 for t in turns if t.trajectory_index < 3)
    # parse-error counts (a call that does not parse is an error, not a call): the continued choice's, the
    # branch's own choice's, and the copies of the base's
    assert main[2].tool_call_errors == 1 and main[2].tool_calls == 0
    assert [t.tool_call_errors for t in branch2] == [0, 0, 1]
