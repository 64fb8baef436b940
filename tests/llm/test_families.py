"""Token truth per model family: scripted multi-turn tool rollouts against each family's published chat template
(bundled in prorl_server/llm/chat_templates/templates, sources in that package's docstring) are one trajectory
whose generated tokens are kept as-is; the token stream equals the canonical rendering where the family
allows it; families that rewrite history split with a reason. The generations are scripted token ids standing
for what a model would return (no vLLM here; tests/llm/test_families_vllm.py runs them against real ones)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prorl_server.llm.chat_templates import (FAMILIES, TEMPLATE_DIR, TEMPLATE_FAMILY, detect_family, family_spec,
                                         load_template)
from prorl_server.llm.conversation import Conversation
from prorl_server.llm.client import Completion
from prorl_server.dev.tiny_model import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command.",
                                           "parameters": {"type": "object",
                                                          "properties": {"cmd": {"type": "string"}}}}}]
START = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List the files."}]
TEMPLATES = sorted(t.removesuffix(".jinja") for t in TEMPLATE_FAMILY)


@pytest.fixture(scope="module")
def toks():
    """Tokenizer of every family test model (one BPE training, shared)."""
    return {t: build_tokenizer(template=t) for t in TEMPLATES}


def call_text(family: str, i: int) -> str:
    """A tool call written the way the family's models write one."""
    cmd = f"ls {i}"
    if family == "llama3":
        return json.dumps({"name": "bash", "parameters": {"cmd": cmd}})
    if family == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": "bash", "arguments": {"cmd": cmd}, "id": f"call{i:05d}"}])
    if family == "gemma":
        return f"```tool_code\nbash({cmd!r})\n```"
    if family == "deepseek":
        return ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>bash\n```json\n"
                + json.dumps({"cmd": cmd}) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    return f'<tool_call>\n{{"name": "bash", "arguments": {{"cmd": "{cmd}"}}}}\n</tool_call>'


def observation(family: str, i: int) -> dict:
    m = {"role": family_spec(family).tool_role, "content": f"file_{i}.py\nREADME.md"}
    if family == "mistral":
        m["tool_call_id"] = f"call{i:05d}"
    return m


def gen(tok, text: str, lp: float = -0.5) -> Completion:
    """What vLLM returns for a turn that generated ``text`` (canonical tokens) and stopped at eos."""
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return Completion(token_ids=ids, logprobs=[lp] * len(ids), finish_reason="stop", stop_reason=None,
                      backend="scripted", weight_versions=[1])


def canonical(tok, messages, **kw) -> list[int]:
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kw)
    return tok.encode(text, add_special_tokens=False)


def generated_spans(traj) -> list[list[int]]:
    return [ids for _, ids in traj.spans()]


async def rollout(tok, turns: list[str], family: str, **kw) -> tuple[Conversation, list[Completion]]:
    conv = Conversation(tok, START, tools=TOOLS, max_context_tokens=16384, **kw)
    gens = []
    for i, text in enumerate(turns):
        gens.append(gen(tok, text))
        conv.add_completion(gens[-1])
        assert await conv.add_messages([observation(family, i)])
    return conv, gens


def test_every_template_is_its_family_and_its_markers_are_single_tokens(toks):
    for name, tok in toks.items():
        family = TEMPLATE_FAMILY[name + ".jinja"]
        assert detect_family(tok.chat_template) == family, name
        for marker in FAMILIES[family].markers:
            assert len(tok.encode(marker, add_special_tokens=False)) == 1, (name, marker)
        assert tok.eos_token == FAMILIES[family].eos


def test_bundled_templates_are_the_published_ones_byte_for_byte():
    trl = pytest.importorskip("trl")
    source = Path(trl.__file__).parent / "chat_templates"
    for name in ("qwen2_5", "qwen3", "llama3_1", "llama3_2", "gemma3", "deepseekv3"):
        assert load_template(name) == (source / f"{name}.jinja").read_text(encoding="utf-8"), name
    from mistral_common.integrations.chat_templates.chat_templates import generate_chat_template
    from mistral_common.tokens.tokenizers.base import TokenizerVersion

    for version in ("v3", "v7"):
        text = generate_chat_template(spm=False, tokenizer_version=TokenizerVersion(version), image_support=False,
                                      audio_support=False, thinking_support=False, default_system_prompt=None,
                                      plain_thinking_support=False, use_special_token_variables=True,
                                      model_settings_fields=None, reasoning_effort_values=None,
                                      reasoning_effort_default=None)
        assert load_template(f"mistral_{version}_tekken") == text
    assert sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja")) == TEMPLATES


def test_family_detection_and_explicit_setting(toks):
    assert detect_family(None) == detect_family("{{ messages }}") == "generic"
    conv = Conversation(toks["qwen2_5"], START, max_context_tokens=4096, family="qwen3")
    assert conv.token_stats()["family"] == "qwen3"
    with pytest.raises(ValueError, match="unknown model family"):
        Conversation(toks["qwen2_5"], START, max_context_tokens=4096, family="gpt-7")
    with pytest.raises(ValueError, match="no bundled chat template"):
        load_template("../conversation")


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3", "llama3_1", "llama3_2", "mistral_v3_tekken",
                                      "mistral_v7_tekken", "gemma3"])
async def test_tool_rollout_is_one_trajectory_equal_to_the_canonical_rendering(toks, template):
    tok = toks[template]
    family = TEMPLATE_FAMILY[template + ".jinja"]
    turns = [f"Step {i}." + ("\n" if family != "mistral" else "") + call_text(family, i) for i in range(8)]
    if family == "qwen3":  # thinking on (the default), spacing as the template writes it
        turns = [f"<think>\nLook at step {i}.\n</think>\n\n{t}" for i, t in enumerate(turns)]
    conv, gens = await rollout(tok, turns, family)
    (traj,) = conv.trajectories()
    assert traj.split_reason is None and traj.num_turns == 8
    assert generated_spans(traj) == [g.token_ids for g in gens]
    ids = traj.prompt_ids + traj.response_ids
    assert tok.decode(ids) == tok.decode(canonical(tok, conv.messages))
    if family != "llama3":
        assert ids == canonical(tok, conv.messages)
    else:  # the generation prompt ends in "\n\n": one token before generated text, two inside a longer text
        assert len(ids) == len(canonical(tok, conv.messages)) - 8
    assert conv.token_stats() == {"family": family, "turns": 8, "splits": {}, "continued": 0,
                                  "rerendered_chars": 0}


@pytest.mark.parametrize("template,turn,kw", [
    # enable_thinking=False: the generation prompt has an empty think block the re-rendered turn has not.
    ("qwen3", "Step {i}.\n{call}", {"chat_template_kwargs": {"enable_thinking": False}}),
    # <think> spacing the model did not produce canonically.
    ("qwen3", "<think>look {i}</think>{call}", {}),
    # Llama 3.x and Gemma trim the re-rendered turn.
    ("llama3_1", "{call}  \n", {}),
    ("llama3_2", "  {call}", {}),
    ("gemma3", "{call}\n\n", {}),
])
async def test_reformatted_turns_keep_their_tokens_in_one_trajectory(toks, template, turn, kw):
    tok = toks[template]
    family = TEMPLATE_FAMILY[template + ".jinja"]
    turns = [turn.format(i=i, call=call_text(family, i)) for i in range(8)]
    conv, gens = await rollout(tok, turns, family, **kw)
    (traj,) = conv.trajectories()
    assert traj.split_reason is None
    ids = traj.prompt_ids + traj.response_ids
    assert generated_spans(traj) == [g.token_ids for g in gens]
    # Each observation run: the rest of the assistant terminator, the observation, the generation prompt.
    tkw = kw.get("chat_template_kwargs", {})
    gen_prompt = tok.apply_chat_template(START, tokenize=False, add_generation_prompt=True, **tkw)[
        len(tok.apply_chat_template(START, tokenize=False, add_generation_prompt=False, **tkw)):]
    rest = {"<|im_end|>": "\n", "<end_of_turn>": "\n"}.get(tok.eos_token, "")
    runs = [ids for _, ids in traj.spans(generated=False)]
    assert len(runs) == 8
    for i, run in enumerate(runs):
        text = tok.decode(run)
        assert text.startswith(rest) and text.endswith(gen_prompt) and f"file_{i}.py" in text, text
    assert ids != canonical(tok, conv.messages, **tkw)  # the template would have rendered the turns differently
    assert conv.token_stats() == {"family": family, "turns": 8, "splits": {}, "continued": 8,
                                  "rerendered_chars": sum(len(m["content"]) for m in conv.messages
                                                          if m["role"] == "assistant")}


async def test_qwen3_continuation_delta_is_verls(toks):
    """The continued delta is the one verl's Qwen Continuous Token builder appends (inserted newline included)."""
    ct = pytest.importorskip("verl.utils.tokenizer.continuous_token")
    tok = toks["qwen3"]
    kw = {"enable_thinking": False}
    conv = Conversation(tok, START, tools=TOOLS, max_context_tokens=16384, chat_template_kwargs=kw)
    builder = ct.QwenContinuousTokenBuilder(tok, chat_template_kwargs=kw)
    for i in range(3):
        conv.add_completion(gen(tok, call_text("qwen3", i)))
        runtime = list(conv.token_ids)
        previous = [dict(m) for m in conv.messages]
        new = [observation("qwen3", i), observation("qwen3", 100 + i)]
        assert await conv.add_messages(new)
        merged = builder.merge_context_tokens(previous, previous + new, runtime, tools=TOOLS)
        assert conv.token_ids == merged.token_ids
    assert conv.token_stats()["continued"] == 3


async def test_llama_continuation_delta_is_verls_default_builder(toks):
    ct = pytest.importorskip("verl.utils.tokenizer.continuous_token")
    tok = toks["llama3_1"]
    conv = Conversation(tok, START, tools=TOOLS, max_context_tokens=16384)
    builder = ct.ContinuousTokenBuilder(tok)
    conv.add_completion(gen(tok, call_text("llama3", 0) + " "))
    runtime, previous = list(conv.token_ids), [dict(m) for m in conv.messages]
    new = [observation("llama3", 0)]
    assert await conv.add_messages(new)
    assert conv.token_ids == builder.merge_context_tokens(previous, previous + new, runtime, tools=TOOLS).token_ids


async def test_qwen3_new_user_message_drops_past_reasoning_and_splits(toks):
    tok = toks["qwen3"]
    conv, _ = await rollout(tok, [f"<think>\nstep {i}\n</think>\n\n{call_text('qwen3', i)}" for i in range(3)],
                            "qwen3")
    conv.add_completion(gen(tok, "<think>\ndone\n</think>\n\nAll listed."))
    assert await conv.add_messages([{"role": "user", "content": "Now count them."}])
    conv.add_completion(gen(tok, "<think>\ncount\n</think>\n\nTwo."))
    t1, t2 = conv.trajectories()
    assert t1.split_reason.startswith("template_drops_generated_text") and t1.num_turns == 4
    assert "reasoning" in t1.split_reason
    # The new segment is the template's own rendering: past reasoning gone.
    assert t2.prompt_ids == canonical(tok, conv.messages[:-1])
    assert "step 0" not in tok.decode(t2.prompt_ids)
    assert conv.token_stats()["splits"] == {"template_drops_generated_text": 1}


async def test_deepseek_first_turn_reasoning_is_dropped_then_tool_turns_are_one_trajectory(toks):
    tok = toks["deepseekv3"]
    # The generation prompt opens <think>; the first turn's reasoning is dropped when rendered again.
    turns = ["Look first.\n</think>\n\n" + call_text("deepseek", 0)] + [call_text("deepseek", i) for i in range(1, 8)]
    conv, gens = await rollout(tok, turns, "deepseek")
    t1, t2 = conv.trajectories()
    assert t1.split_reason.startswith("template_drops_generated_text") and (t1.num_turns, t2.num_turns) == (1, 7)
    assert generated_spans(t2) == [g.token_ids for g in gens[1:]]
    assert t2.prompt_ids + t2.response_ids == canonical(tok, conv.messages)
    assert conv.token_stats()["splits"] == {"template_drops_generated_text": 1}


async def test_mistral_moves_the_tools_to_the_last_user_message_and_splits(toks):
    tok = toks["mistral_v7_tekken"]
    conv, _ = await rollout(tok, [call_text("mistral", i) for i in range(2)], "mistral")
    conv.add_completion(gen(tok, "Two files."))
    assert await conv.add_messages([{"role": "user", "content": "And now?"}])
    t1, t2 = conv.trajectories()
    assert t1.split_reason.startswith("template_not_append_only")
    assert t2.prompt_ids == canonical(tok, conv.messages)


async def test_window_and_full_rendering_agree_for_every_family(toks):
    for template in TEMPLATES:
        tok = toks[template]
        family = TEMPLATE_FAMILY[template + ".jinja"]
        turns = [f"ok {i} " + call_text(family, i) for i in range(5)]
        a, _ = await rollout(tok, turns, family, window=True)
        b, _ = await rollout(tok, turns, family, window=False)
        assert a.token_ids == b.token_ids, template
        assert a.token_stats() == b.token_stats(), template


async def test_gemma_tool_observations_are_rendered_as_user_turns(toks):
    tok = toks["gemma3"]
    conv = Conversation(tok, START, tools=TOOLS, max_context_tokens=16384)
    for i in range(3):
        conv.add_completion(gen(tok, call_text("gemma", i)))
        assert await conv.add_messages([{"role": "tool", "content": f"out {i}"}])
    assert [m["role"] for m in conv.messages[2:]] == ["assistant", "tool"] * 3  # the messages stay as given
    as_user = [{**m, "role": "user"} if m["role"] == "tool" else m for m in conv.messages]
    (traj,) = conv.trajectories()
    assert traj.prompt_ids + traj.response_ids == canonical(tok, as_user)
    with pytest.raises(Exception, match="alternate"):  # what the template itself says of a tool role
        tok.apply_chat_template(conv.messages, tokenize=False)
