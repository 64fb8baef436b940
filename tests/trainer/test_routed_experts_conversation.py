"""Routed experts (R3, issue #32 part 7) in one conversation: the record of a row is the latest answer's word
for the positions it covers, a gap or a turn without routes ends it (never a record with holes that would replay
zeros), a dense model's rows have none, and the client refuses a record that covers more positions than the
request has. Scripted completions stand for what a backend returns (no backend runs)."""
from __future__ import annotations

import pytest

from prorl_server.balancer import Backend
from prorl_server.llm.client import Completion, LLMClient, LLMError
from prorl_server.llm.conversation import Conversation


def turn(tok, text: str, routes=None, start: int = 0) -> Completion:
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", stop_reason=None,
                      backend="scripted", weight_versions=[1], routed_experts=routes, routed_experts_start=start)


def routes_for(n: int, tag: int) -> list:
    return [[[tag, p % 100]] for p in range(n)]


async def two_turns(tok, first, second):
    conv = Conversation(tok, [{"role": "user", "content": "hi"}], max_context_tokens=4096)
    n0 = conv.num_tokens
    a = turn(tok, "one", *first(n0))
    conv.add_completion(a)
    assert await conv.add_messages([{"role": "user", "content": "more"}])
    n1 = conv.num_tokens
    conv.add_completion(turn(tok, "two", *second(n0, n1)))
    (t,) = conv.trajectories()
    return t, n0, n1


async def test_each_answer_gives_the_routes_of_the_positions_it_covers(tokenizer):
    # the second answer covers the whole context again (a verl relay): it is the record, up to its last token
    t, _, n1 = await two_turns(tokenizer, lambda n: (routes_for(n + 1, 1),),
                               lambda n0, n1: (routes_for(n1 + 1, 2),))
    assert t.routed_experts == routes_for(n1 + 1, 2)
    # an answer that covers only the positions after those held (vLLM's routed_experts_prompt_start) keeps them
    t, n0, n1 = await two_turns(tokenizer, lambda n: (routes_for(n + 1, 1),),
                                lambda n0, n1: (routes_for(n1 - n0, 2), n0 + 1))
    assert t.routed_experts == routes_for(n0 + 1, 1) + routes_for(n1 - n0, 2)


async def test_a_gap_or_a_turn_without_routes_ends_the_record(tokenizer):
    t, _, _ = await two_turns(tokenizer, lambda n: (routes_for(n + 1, 1),), lambda n0, n1: (None,))
    assert t.routed_experts is None
    t, _, _ = await two_turns(tokenizer, lambda n: (routes_for(2, 1),), lambda n0, n1: (routes_for(2, 2), n1 - 1))
    assert t.routed_experts is None  # positions 2 .. n1-2 were never reported
    t, _, _ = await two_turns(tokenizer, lambda n: (None,), lambda n0, n1: (None,))
    assert t.routed_experts is None  # a dense model


def test_the_client_refuses_a_record_longer_than_the_request():
    data = {"choices": [{"token_ids": [7, 8], "finish_reason": "stop", "logprobs": {"token_logprobs": [-1, -1]}}],
            "routed_experts": [[[0, 1]]] * 6, "routed_experts_start": 0}
    b = Backend("http://backend")
    with pytest.raises(LLMError, match="6 positions for 5 tokens"):  # 3 prompt + 2 generated
        LLMClient._completion(data, data["choices"][0], b, None, 0.0, 1, 0, 0, prompt_len=3)
    data["routed_experts"] = [[[0, 1]]] * 5
    assert len(LLMClient._completion(data, data["choices"][0], b, None, 0.0, 1, 0, 0,
                                     prompt_len=3).routed_experts) == 5


async def test_an_answer_with_another_route_shape_ends_the_record(tokenizer):
    # each answer's record passes the client's check on its own; joined they would hold two shapes
    t, n0, n1 = await two_turns(tokenizer, lambda n: (routes_for(n + 1, 1),),
                                lambda n0, n1: ([[[2, 0], [2, 1]]] * (n1 - n0), n0 + 1))
    assert t.routed_experts is None


async def test_the_joined_record_is_not_checked_again_on_the_event_loop(tokenizer, monkeypatch):
    import prorl_server.types as types

    calls = []
    real = types.route_shape_error
    monkeypatch.setattr(types, "route_shape_error", lambda *a: calls.append(len(a[0])) or real(*a))
    t, n0, n1 = await two_turns(tokenizer, lambda n: (routes_for(n + 1, 1),),
                                lambda n0, n1: (routes_for(n1 - n0, 2), n0 + 1))
    assert t.routed_experts == routes_for(n0 + 1, 1) + routes_for(n1 - n0, 2)
    assert calls == []  # the client checked each answer's record; the conversation only joined them
