"""Conversation state keeps token truth: deltas, stop tokens, template splits, context limit (no vLLM; the
generations are scripted token ids standing for what a model would return)."""
from __future__ import annotations

import copy

import pytest

from prorl_server.llm.conversation import OFFLOAD_CHARS, ContextLengthError, Conversation
from prorl_server.llm.client import Completion

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command.",
                                           "parameters": {"type": "object",
                                                          "properties": {"cmd": {"type": "string"}}}}}]
START = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List the files."}]


def gen(tok, text: str, stop: str | None = "<|im_end|>", lp: float = -0.5) -> Completion:
    """What vLLM returns for a turn that generated ``text`` (canonical tokens) and then ``stop``."""
    ids = tok.encode(text, add_special_tokens=False)
    if stop is not None:
        ids = ids + [tok.convert_tokens_to_ids(stop)]
    return Completion(token_ids=ids, logprobs=[lp] * len(ids), finish_reason="stop" if stop else "length",
                      stop_reason=None if stop in (None, "<|im_end|>") else tok.convert_tokens_to_ids(stop),
                      backend="scripted", weight_versions=[3])


def render(tok, messages, **kw):
    return tok.apply_chat_template([{k: v for k, v in m.items() if k != "tool_calls"} for m in messages],
                                   tools=TOOLS, tokenize=False, **kw)


async def play(conv: Conversation, tok, turns: int):
    for i in range(turns):
        conv.add_completion(gen(tok, f'Step {i}.\n<tool_call>\n{{"name": "bash", "arguments": {{"cmd": "ls {i}"}}}}'
                                     f"\n</tool_call>"))
        assert await conv.add_messages([{"role": "tool", "content": f"file_{i}.py\nREADME.md"}])


async def test_appended_deltas_equal_tokenizing_the_whole_rendering(tokenizer):
    conv = Conversation(tokenizer, START, tools=TOOLS, max_context_tokens=4096)
    await play(conv, tokenizer, 3)
    conv.add_completion(gen(tokenizer, "I see two tools' outputs.", stop=None))  # cut by max_tokens
    assert await conv.add_messages([{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"},
                                    {"role": "user", "content": "Go on."}])
    conv.add_completion(gen(tokenizer, "Done."))
    full = render(tokenizer, conv.messages)
    (traj,) = conv.trajectories()
    ids = traj.prompt_ids + traj.response_ids
    # The stream is exactly the template's rendering, token for token, up to the final "\n" after the
    # last <|im_end|> (a generated turn ends at its stop token).
    assert tokenizer.decode(ids, skip_special_tokens=False) + "\n" == full
    assert ids == tokenizer.encode(full, add_special_tokens=False)[:-1]


async def test_loss_mask_and_logprobs_cover_exactly_the_generated_tokens(tokenizer):
    conv = Conversation(tokenizer, START, tools=TOOLS, max_context_tokens=4096)
    gens = [gen(tokenizer, f"turn {i} <tool_call>", lp=-0.1 * (i + 1)) for i in range(3)]
    for g in gens:
        conv.add_completion(g)
        assert await conv.add_messages([{"role": "tool", "content": "ok"}])
    (traj,) = conv.trajectories()
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.response_logprobs)
    generated = [t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 1]
    assert generated == [t for g in gens for t in g.token_ids]
    assert [lp for lp, m in zip(traj.response_logprobs, traj.loss_mask) if m == 1] == \
        [lp for g in gens for lp in g.logprobs]
    assert all(lp == 0.0 for lp, m in zip(traj.response_logprobs, traj.loss_mask) if m == 0)
    assert traj.num_turns == 3 and traj.weight_versions == [3]
    assert traj.prompt_ids == tokenizer.encode(render(tokenizer, START, add_generation_prompt=True),
                                               add_special_tokens=False)


async def test_stop_token_outside_the_template_stays_in_the_content(tokenizer):
    conv = Conversation(tokenizer, START, tools=TOOLS, max_context_tokens=4096)
    msg = conv.add_completion(gen(tokenizer, "hello", stop="<|endoftext|>"))
    assert msg["content"] == "hello<|endoftext|>"
    assert await conv.add_messages([{"role": "user", "content": "more"}])
    conv.add_completion(gen(tokenizer, "bye"))
    assert conv.messages[-1]["content"] == "bye"  # <|im_end|> is the template's own terminator
    (traj,) = conv.trajectories()
    text = tokenizer.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert text + "\n" == render(tokenizer, conv.messages)
    assert traj.split_reason is None


async def test_window_rendering_agrees_with_full_rendering_over_a_long_rollout(tokenizer):
    a = Conversation(tokenizer, START, tools=TOOLS, max_context_tokens=16384, window=True)
    b = Conversation(tokenizer, START, tools=TOOLS, max_context_tokens=16384, window=False)
    await play(a, tokenizer, 40)
    await play(b, tokenizer, 40)
    assert a.token_ids == b.token_ids
    assert a.metrics["splits"] == b.metrics["splits"] == 0


async def test_non_append_only_template_starts_a_new_segment_and_says_why(tokenizer):
    tok = copy.deepcopy(tokenizer)
    # A template that rewrites history: it shows how many messages follow the system prompt.
    tok.chat_template = ("<|im_start|>system\n{{ messages|length }} messages<|im_end|>\n"
                         "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for window in (True, False):
        conv = Conversation(tok, START[1:], max_context_tokens=4096, window=window)
        first = gen(tok, "one")
        conv.add_completion(first)
        assert await conv.add_messages([{"role": "user", "content": "again"}])
        conv.add_completion(gen(tok, "two"))
        conv.finish("no_tool_call")
        t1, t2 = conv.trajectories()
        assert t1.split_reason.startswith("template_not_append_only")
        assert t1.finish_reason == "split" and t2.finish_reason == "no_tool_call"
        assert t1.response_ids == first.token_ids and t1.loss_mask == [1] * len(first.token_ids)
        # The new segment starts from a fresh rendering of everything, never a silent re-tokenization.
        fresh = tok.apply_chat_template(conv.messages[:-1], tokenize=False, add_generation_prompt=True)
        assert t2.prompt_ids == tok.encode(fresh, add_special_tokens=False)
        assert (t1.num_turns, t2.num_turns) == (1, 1)
        assert conv.metrics["splits"] == 1
        assert conv.token_stats()["splits"] == {"template_not_append_only": 1}


async def test_template_that_trims_the_assistant_text_keeps_the_generated_tokens_and_reports_it(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    conv = Conversation(tok, START, max_context_tokens=4096)
    first = gen(tok, "padded   ")
    conv.add_completion(first)
    before = list(conv.token_ids)
    assert await conv.add_messages([{"role": "user", "content": "next"}])
    (traj,) = conv.trajectories()
    assert traj.split_reason is None
    # The generated "padded   <|im_end|>" stays; what follows is the terminator's "\n" and the rendered user turn.
    assert conv.token_ids[:len(before)] == before and before[-len(first.token_ids):] == first.token_ids
    assert tok.decode(conv.token_ids[len(before):], skip_special_tokens=False) == \
        "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"
    assert conv.token_stats() == {"family": "chatml", "turns": 1, "splits": {}, "continued": 1,
                                  "rerendered_chars": len("padded   ")}


async def test_observation_that_would_overflow_the_context_is_refused(tokenizer):
    conv = Conversation(tokenizer, START, tools=TOOLS, max_context_tokens=400)
    conv.add_completion(gen(tokenizer, "look"))
    before = (list(conv.token_ids), len(conv.messages))
    assert not await conv.add_messages([{"role": "tool", "content": "x " * 500}])
    assert (conv.token_ids, len(conv.messages)) == before
    assert conv.metrics["refused_messages"] == 1
    assert conv.room == 400 - len(before[0])


def test_generated_turn_larger_than_the_room_is_refused(tokenizer):
    conv = Conversation(tokenizer, START, tools=TOOLS, max_context_tokens=250)
    with pytest.raises(RuntimeError, match="exceed"):
        conv.add_completion(gen(tokenizer, "word " * 300))


def test_prompt_that_fills_the_context_is_an_error(tokenizer):
    with pytest.raises(ContextLengthError):
        Conversation(tokenizer, [{"role": "user", "content": "y " * 3000}], max_context_tokens=1000)


async def test_new_messages_must_follow_a_generated_turn(tokenizer):
    conv = Conversation(tokenizer, START, max_context_tokens=4096)
    with pytest.raises(RuntimeError, match="add_completion"):
        await conv.add_messages([{"role": "user", "content": "hi"}])


async def test_large_observation_is_tokenized_off_the_event_loop(tokenizer, monkeypatch):
    import asyncio

    calls = []
    real = asyncio.to_thread

    async def spy(fn, *a, **kw):
        calls.append(fn)
        return await real(fn, *a, **kw)

    monkeypatch.setattr(asyncio, "to_thread", spy)
    conv = await Conversation.create(tokenizer, START, tools=TOOLS, max_context_tokens=16384)
    conv.add_completion(gen(tokenizer, "cat big.log"))
    big = "line of a long build log\n" * (OFFLOAD_CHARS // 20)
    assert await conv.add_messages([{"role": "tool", "content": big}])
    assert len(calls) == 1
    (traj,) = conv.trajectories()
    assert tokenizer.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False) == \
        render(tokenizer, conv.messages, add_generation_prompt=True)


async def test_given_tool_calls_are_rendered_and_generated_ones_are_not_rendered_twice(tokenizer):
    few_shot = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"cmd": "pwd"}}}]}
    msgs = START + [few_shot, {"role": "tool", "content": "/root"}, {"role": "user", "content": "Now list."}]
    conv = Conversation(tokenizer, msgs, tools=TOOLS, max_context_tokens=4096)
    assert '{"name": "bash", "arguments": {"cmd": "pwd"}}' in tokenizer.decode(conv.token_ids)
    generated = '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
    msg = conv.add_completion(gen(tokenizer, generated))
    msg["tool_calls"] = [{"type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]
    assert await conv.add_messages([{"role": "tool", "content": "a.py"}])
    text = tokenizer.decode(conv.token_ids, skip_special_tokens=False)
    assert text.count('"cmd": "ls"') == 1 and conv.metrics["splits"] == 0


async def test_conversations_that_append_the_same_text_stay_token_exact_and_independent(tokenizer):
    """Short appended texts are encoded once per tokenizer and remembered (issue #26); each conversation still
    gets its own token list: a second rollout with the same feedback is the same tokens as the first, and
    growing one never changes the other or what the next one is given."""
    convs = []
    for i in range(3):
        conv = Conversation(tokenizer, START, tools=TOOLS, max_context_tokens=4096)
        conv.add_completion(gen(tokenizer, f"Answer {i}."))
        assert await conv.add_messages([{"role": "user", "content": "Louder!"}])
        convs.append(conv)
    convs[0].add_completion(gen(tokenizer, "MORE."))
    for conv in convs[1:]:
        (traj,) = conv.trajectories()
        ids = traj.prompt_ids + traj.response_ids
        full = render(tokenizer, conv.messages, add_generation_prompt=True)
        assert ids == tokenizer.encode(full, add_special_tokens=False)


async def test_a_megabyte_prompt_is_tokenized_without_stalling_the_event_loop(tokenizer):
    """A gateway request of ~1.9 MB (under the body limit, far past the context) is rendered and tokenized in a
    worker thread; the Rust tokenizer's single encode held the GIL all along, so the loop stalled ~4 s anyway
    (red team B). The long text now goes through its batch call, which releases it: the same ids, no stall."""
    import asyncio
    import time

    gaps: list[float] = []
    stop = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    # 180 tool calls of 10 kB arguments beside short contents: rendered on the loop itself before (3.3 s)
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "[" + ",".join(["1"] * 5000)
                                                                + "]"}} for i in range(180)]
    wide = ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls}]
            + [{"role": "tool", "tool_call_id": f"c{i}", "content": "r"} for i in range(180)]
            + [{"role": "user", "content": "go"}])
    task = asyncio.create_task(ticker())
    try:
        for messages in ([{"role": "user", "content": "1," * 950_000}], wide):
            with pytest.raises(ContextLengthError):
                await Conversation.create(tokenizer, messages, max_context_tokens=1 << 20)
    finally:
        stop = True
        await task
    assert max(gaps) < 0.5, f"the event loop stalled {max(gaps):.2f} s"  # 3.9 s and 3.3 s before
    text = "def f(x):\n    return x * 2  # é中文\n" * 2000
    conv = await Conversation.create(tokenizer, [{"role": "user", "content": text}], max_context_tokens=1 << 20)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    assert conv.token_ids == tokenizer.encode(rendered, add_special_tokens=False)
