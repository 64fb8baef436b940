"""vLLM's tool parsers per model family, behind ``get_parser(name, tokenizer, tools=...)``.

The model output parsed here is what each family's published chat template writes for an assistant turn
with tool calls (Qwen3.5's, Llama 3.1's and DeepSeek-V3's as trl ships them, Mistral's as mistral-common
generates it), or, where no template ships here (pythonic, DeepSeek-V3.1, Kimi-K2), the format vLLM's
docs give. Tokenizers: the tiny test model's, with the family's marker tokens added as special tokens (the
parsers only look the markers up in the vocabulary; the real families' tokenizers have them the same way),
and for Mistral also mistral-common's own v7 tokenizer file, through vLLM's ``MistralTokenizer``.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest

from prorl_server.llm.tool_parser import (PARSERS, HermesToolParser, ToolCall, ToolCallError, VllmToolParser, get_parser,
                                      new_call_id, vllm_parser_names)

pytest.importorskip("vllm")
trl = pytest.importorskip("trl")
TEMPLATES = Path(trl.__file__).parent / "chat_templates"

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CALLS = [{"id": "AbCdE1234", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
         {"id": "ZyXwV9876", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]
EXPECTED = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome"})]

DEEPSEEK = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>"]
KIMI = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
        "<|tool_call_argument_begin|>"]
MARKERS = {"qwen3_coder": [], "qwen3_xml": [], "llama3_json": ["<|python_tag|>"], "pythonic": [],
           "mistral": ["[TOOL_CALLS]", "[ARGS]"], "mistral_v7": ["[TOOL_CALLS]"], "deepseek_v3": DEEPSEEK, "deepseek_v31": DEEPSEEK,
           "kimi_k2": KIMI, "vllm:hermes": []}


@pytest.fixture(scope="module")
def family_tokenizer(tiny_model_dir):
    """``family_tokenizer(name)``: the tiny tokenizer with ``name``'s family marker tokens added."""
    from transformers import AutoTokenizer

    cache: dict[str, object] = {}

    def make(name: str):
        if name not in cache:
            tok = AutoTokenizer.from_pretrained(tiny_model_dir)
            tok.add_special_tokens({"additional_special_tokens": MARKERS[name]})
            cache[name] = tok
        return cache[name]
    return make


@pytest.fixture(scope="module")
def parser(family_tokenizer):
    """``parser(key)``: ``get_parser(name, family_tokenizer(key), tools=TOOLS)``, built once per key; the name
    is the key up to ``_v``: ``mistral_v7`` is the ``mistral`` parser on a v7 tokenizer (no ``[ARGS]``: the
    parser reads the v7 JSON-array form), ``mistral`` on a v11+ one (``[TOOL_CALLS]name[ARGS]{...}``)."""
    cache: dict[str, object] = {}

    def make(key: str):
        if key not in cache:
            cache[key] = get_parser(key.split("_v7")[0], family_tokenizer(key), tools=TOOLS)
        return cache[key]
    return make


def generated(tokenizer, template: str, assistant_header: str, end_of_turn: str, *, content=None,
              calls=CALLS, string_args=False) -> str:
    """What the model writes for an assistant turn with ``calls``, as the family's chat template renders it."""
    if string_args:  # templates that concatenate arguments as text (DeepSeek's)
        calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                 for c in calls]
    msgs = [{"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": content, "tool_calls": calls}]
    full = tokenizer.apply_chat_template(msgs, tools=TOOLS, chat_template=template, tokenize=False)
    prompt = tokenizer.apply_chat_template(msgs[:1], tools=TOOLS, chat_template=template, tokenize=False,
                                           add_generation_prompt=True)
    # after the generation prompt; DeepSeek's opens a <think> its history leaves out: after the header there
    turn = full[len(prompt):] if full.startswith(prompt) else full.rsplit(assistant_header, 1)[1]
    assert end_of_turn in turn, turn
    return turn[:turn.rindex(end_of_turn)]


def mistral_template(version: str) -> str:
    from mistral_common.integrations.chat_templates.template_generator import TemplateConfig, build_chat_template
    from mistral_common.tokens.tokenizers.base import TokenizerVersion

    return build_chat_template(TemplateConfig(version=TokenizerVersion(version)))


def calls_of(turn) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) for c in turn.calls]


# ------------------------------------------------------------------------------------- registry
def test_names_come_from_vllms_registry_without_importing_vllm():
    """Listing and checking names (what settings validation does) must not pay vLLM's import."""
    import subprocess

    code = ("import sys; from prorl_server.llm.tool_parser import PARSERS, vllm_parser_names; "
            "assert 'qwen3_coder' in PARSERS and 'mistral' in PARSERS and 'vllm:hermes' in PARSERS; "
            "assert 'nope' not in PARSERS and 'vllm:nope' not in PARSERS; "
            "print(len(vllm_parser_names()), 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) >= 40 and out[1] == "False"


def test_vllm_names_match_its_tool_parser_manager():
    from vllm.tool_parsers import ToolParserManager

    assert set(vllm_parser_names()) == set(ToolParserManager.list_registered())
    assert {"hermes", "qwen3_xml", "qwen3_coder", "llama3_json", "mistral", "pythonic", "deepseek_v3"} <= set(PARSERS)


def test_get_parser_picks_ours_or_vllms(family_tokenizer):
    assert isinstance(get_parser("hermes"), HermesToolParser)  # no tokenizer needed, vLLM not used
    p = get_parser("vllm:hermes", family_tokenizer("vllm:hermes"))
    assert isinstance(p, VllmToolParser) and p.vllm_name == "hermes"
    assert isinstance(get_parser("pythonic", family_tokenizer("pythonic")), VllmToolParser)


def test_vllm_parser_needs_a_tokenizer_with_the_family_markers(family_tokenizer):
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        get_parser("mistral")
    with pytest.raises(ValueError, match="cannot use this tokenizer"):  # the Qwen tokenizer has no [TOOL_CALLS]
        get_parser("mistral", family_tokenizer("qwen3_coder"))
    with pytest.raises(KeyError, match="qwen3_coder"):
        get_parser("nope", family_tokenizer("qwen3_coder"))


# ------------------------------------------------------------------------------------- families
def test_qwen3_coder_xml_from_the_qwen35_template(parser, family_tokenizer):
    tok = family_tokenizer("qwen3_coder")
    text = generated(tok, (TEMPLATES / "qwen3_5_nothink.jinja").read_text(), "<|im_start|>assistant\n",
                     "<|im_end|>", content="Checking both.")
    assert "<function=get_weather>" in text and "<parameter=days>\n3\n</parameter>" in text
    for name in ("qwen3_coder", "qwen3_xml"):
        t = parser(name).parse(text)
        assert calls_of(t) == EXPECTED  # days typed from the tool schema: 3, not "3"
        assert t.errors == [] and t.content == "Checking both."
        assert [type(i) for i in t.items] == [ToolCall, ToolCall]


def test_llama3_json_from_the_llama31_template(parser, family_tokenizer):
    tok = family_tokenizer("llama3_json")
    text = generated(tok, (TEMPLATES / "llama3_1.jinja").read_text(),
                     "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", calls=CALLS[:1])
    assert text == '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
    assert calls_of(parser("llama3_json").parse(text)) == EXPECTED[:1]
    # several calls after <|python_tag|>, separated by "; " (vLLM's documented llama3_json form)
    two = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; ' \
          '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert calls_of(parser("llama3_json").parse(two)) == EXPECTED


def test_deepseek_v3_from_its_template(parser, family_tokenizer):
    tok = family_tokenizer("deepseek_v3")
    text = generated(tok, (TEMPLATES / "deepseekv3.jinja").read_text(), "<｜Assistant｜>", "<｜end▁of▁sentence｜>",
                     string_args=True)
    assert text.startswith("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json")
    t = parser("deepseek_v3").parse("Let me check." + text)
    assert calls_of(t) == EXPECTED and t.errors == [] and t.content == "Let me check."


@pytest.mark.parametrize("name, text", [
    ("pythonic", '[get_weather(city="Paris", days=3), get_weather(city="Rome")]'),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                     '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
                     '{"city": "Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1'
                '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>'),
])
def test_documented_formats(parser, name, text):
    t = parser(name).parse(text)
    assert calls_of(t) == EXPECTED and t.errors == [] and t.content == ""


@pytest.mark.parametrize("version, key", [("v7", "mistral_v7"), ("v13", "mistral")])
def test_mistral_from_mistral_commons_template(parser, family_tokenizer, version, key):
    text = generated(family_tokenizer(key), mistral_template(version), "[/INST]", "</s>")
    assert text.startswith("[TOOL_CALLS]")  # v7: one JSON array; v13: [TOOL_CALLS]name[ARGS]{...} per call
    t = parser(key).parse(text)
    assert calls_of(t) == EXPECTED and t.errors == []


def test_mistral_with_mistral_commons_own_tokenizer():
    """The tokenizer as vLLM loads a Mistral model in ``mistral`` tokenizer mode (v7 file shipped with
    mistral-common), not a transformers one."""
    import mistral_common
    from mistral_common.protocol.instruct.validator import ValidationMode
    from transformers.tokenization_mistral_common import MistralCommonBackend
    from vllm.tokenizers.mistral import MistralTokenizer

    path = Path(mistral_common.__file__).parent / "data" / "mistral_instruct_tokenizer_241114.model.v7"
    tok = MistralTokenizer(MistralCommonBackend(tokenizer_path=path, mode=ValidationMode.test))
    p = get_parser("mistral", tok, tools=TOOLS)
    t = p.parse('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert calls_of(t) == EXPECTED
    bad = p.parse('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par')
    assert bad.calls == [] and len(bad.errors) == 1 and bad.content == "Sure."


def test_plain_text_is_content_for_every_family(parser):
    for name in MARKERS:
        t = parser(name).parse("The answer is 42 [see note {1}].")
        assert not t.attempted and t.content == "The answer is 42 [see note {1}].", name


def test_content_is_the_text_as_written_when_there_is_no_call(parser):
    """vLLM's qwen3 parser drops ``</think>`` from content when there is no call; the text is kept whole."""
    assert parser("qwen3_coder").parse("<think>hm</think>ok").content == "<think>hm</think>ok"


# ------------------------------------------------------------------------------------- malformed
QWEN_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("name, text, fragment", [
    # cut by max_tokens inside a call
    ("qwen3_coder", "Checking.\n" + QWEN_CALL[:45], "unterminated <tool_call>"),
    # closed block, but the function inside never closed: vLLM returns the call with {} arguments
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>", "unterminated"),
    ("qwen3_coder", "<tool_call>get_weather(city=Paris)</tool_call>", "1 of 1 tool calls could not be parsed"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', "could not be parsed"),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}', "could not be parsed"),
    ("pythonic", '[get_weather(city="Paris"', "could not be parsed"),
    ("mistral_v7", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', "could not be parsed"),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', "malformed tool call"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Par', "unterminated <｜tool▁call▁begin｜>"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{not json}<｜tool▁call▁end｜>"
                     "<｜tool▁calls▁end｜>", "tool call"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Par', "unterminated <|tool_call_begin|>"),
    ("vllm:hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}', "unterminated"),
])
def test_malformed_call_is_an_error_not_an_exception(parser, name, text, fragment, caplog):
    with caplog.at_level(logging.DEBUG):
        t = parser(name).parse(text)
    assert t.calls == [] and len(t.errors) == 1 and t.attempted, (t.calls, t.errors)
    assert fragment in t.errors[0].message
    assert t.items == t.errors
    assert not [r for r in caplog.records if r.name.startswith("vllm")]  # vLLM's tracebacks are silenced


def test_a_good_call_before_a_cut_one_is_kept(parser):
    t = parser("qwen3_coder").parse(QWEN_CALL + "\n" + QWEN_CALL[:60])
    assert calls_of(t) == [("get_weather", {"city": "Paris"})]
    assert len(t.errors) == 1 and "unterminated" in t.errors[0].message
    assert [type(i) for i in t.items] == [ToolCall, ToolCallError]


def test_arguments_that_are_not_an_object_are_an_error(parser):
    t = parser("llama3_json").parse('{"name": "get_weather", "parameters": [1, 2]}')
    assert t.calls == [] and '"arguments" must be a JSON object' in t.errors[0].message


def test_parsing_twice_gives_the_same_calls(parser):
    """vLLM's parsers keep streaming state on the instance; one instance serves every turn here."""
    text = "Checking.\n" + QWEN_CALL
    p = parser("qwen3_coder")
    assert calls_of(p.parse(text)) == calls_of(p.parse(text)) == [("get_weather", {"city": "Paris"})]


def test_tools_per_parse_type_the_arguments(family_tokenizer):
    p = get_parser("qwen3_coder", family_tokenizer("qwen3_coder"))  # no tools: values stay as written
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    assert p.parse(text).calls[0].arguments == {"days": "3"}
    assert p.parse(text, tools=TOOLS).calls[0].arguments == {"days": 3}


def test_vllm_hermes_loses_calls_the_hand_written_one_keeps(parser):
    """Why ``hermes`` stays hand-written: vLLM's drops every call of a turn with one it cannot read."""
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "c"}</tool_call>'
    assert [c.name for c in get_parser("hermes").parse(text).calls] == ["a", "c"]
    theirs = parser("vllm:hermes").parse(text)
    assert theirs.calls == [] and len(theirs.errors) == 1


def test_parse_latency(parser):
    """Per-parse cost (the docstring's numbers): well under a millisecond either way."""
    text = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls -la"}}\n</tool_call>\nDone?'
    for p in (get_parser("hermes"), parser("vllm:hermes")):
        t0 = time.perf_counter()
        for _ in range(100):
            p.parse(text)
        assert (time.perf_counter() - t0) / 100 < 2e-3


# ------------------------------------------------------------------------------------- ids
@pytest.mark.parametrize("version", ["v3", "v7", "v11"])
def test_mistral_ids_pass_the_mistral_template(parser, family_tokenizer, version):
    """Mistral templates raise on an id that is not 9 alphanumerics: ours (calls and errors) pass, and the
    ``call_<hex>`` form of other families does not (the template really checks)."""
    tok = family_tokenizer("mistral")
    p = parser("mistral")
    good = p.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}').calls[0]
    error = p.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Par').errors[0]
    template = mistral_template(version)

    def render(call_id: str, name: str = "get_weather") -> str:
        msgs = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
        return tok.apply_chat_template(msgs, tools=TOOLS, chat_template=template, tokenize=False)

    assert good.id in render(good.id) and error.id in render(error.id)
    assert good.to_openai()["id"] == good.id
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="9 characters"):
        render(new_call_id("hermes"))
