"""Hermes tool-call parsing: what the model wrote becomes calls, or errors it is told about; never a crash.

vLLM's parsers for the other families: test_tool_parser_vllm.py."""
from __future__ import annotations

import re

import pytest

from prorl_server.llm.tool_parser import HermesToolParser, ToolCall, ToolCallError, get_parser, new_call_id

P = HermesToolParser()


def test_single_call_with_text_around_it():
    t = P.parse('Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls -la"}}\n</tool_call>\nDone?')
    assert [(c.name, c.arguments) for c in t.calls] == [("bash", {"cmd": "ls -la"})]
    assert t.errors == []
    assert t.content == "Let me look.\n\nDone?"
    assert t.calls[0].raw.startswith("<tool_call>") and t.calls[0].raw.endswith("</tool_call>")


def test_multiple_calls_in_one_turn_keep_their_order():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": {}}</tool_call><tool_call>{"name": "c"}</tool_call>')
    t = P.parse(text)
    assert [c.name for c in t.calls] == ["a", "b", "c"]
    assert t.calls[2].arguments == {}
    assert [type(i) for i in t.items] == [ToolCall, ToolCall, ToolCall]
    assert t.content == "and"
    assert len({c.id for c in t.calls}) == 3


def test_no_call_is_plain_content():
    t = P.parse("The answer is 42.")
    assert not t.attempted and t.content == "The answer is 42."


@pytest.mark.parametrize("body, fragment", [
    ('{"name": "bash", "arguments": {"cmd": "ls"}', "not valid JSON"),
    ('["bash"]', "expected a JSON object"),
    ('{"arguments": {}}', 'missing "name"'),
    ('{"name": "bash", "arguments": [1, 2]}', '"arguments" must be a JSON object'),
    ('{"name": "bash", "arguments": "{not json"}', "not JSON"),
])
def test_malformed_call_is_an_error_not_an_exception(body, fragment):
    t = P.parse(f"x <tool_call>{body}</tool_call> y")
    assert t.calls == [] and len(t.errors) == 1
    assert fragment in t.errors[0].message
    assert t.attempted
    assert t.content == "x  y"


def test_malformed_and_good_calls_mix_in_text_order():
    t = P.parse('<tool_call>{bad}</tool_call><tool_call>{"name": "ok", "arguments": {}}</tool_call>')
    assert [type(i) for i in t.items] == [ToolCallError, ToolCall]
    assert t.calls[0].name == "ok"


def test_arguments_as_json_string_are_decoded():
    t = P.parse('<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call>')
    assert t.calls[0].arguments == {"k": 2}


def test_unterminated_call_cut_by_max_tokens():
    t = P.parse('thinking <tool_call>{"name": "bash", "argum')
    assert t.calls == [] and "unterminated" in t.errors[0].message
    assert t.content == "thinking"


def test_stray_closing_tag():
    t = P.parse('oops </tool_call> <tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert [c.name for c in t.calls] == ["a"]
    assert any("without <tool_call>" in e.message for e in t.errors)


def test_unclosed_then_closed_call_reports_the_unclosed_one():
    t = P.parse('<tool_call>{"name": "a"<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert [c.name for c in t.calls] == ["b"]
    assert "nested" in t.errors[0].message


def test_openai_form_round_trips_arguments():
    import json

    c = P.parse('<tool_call>{"name": "f", "arguments": {"s": "é"}}</tool_call>').calls[0]
    oa = c.to_openai()
    assert oa["type"] == "function" and oa["function"]["name"] == "f"
    assert json.loads(oa["function"]["arguments"]) == {"s": "é"}


def test_registry():
    assert isinstance(get_parser("hermes"), HermesToolParser)
    assert get_parser(P) is P
    with pytest.raises(KeyError, match="hermes"):
        get_parser("nope")


def test_ids_follow_the_family():
    """Mistral templates accept only 9 alphanumerics (rendered in test_tool_parser_vllm.py); others call_<hex>."""
    assert re.fullmatch(r"[A-Za-z0-9]{9}", new_call_id("mistral"))
    assert re.fullmatch(r"[A-Za-z0-9]{9}", new_call_id("vllm:mistral"))
    for name in ("hermes", "qwen3_coder", "llama3_json", "deepseek_v3"):
        assert re.fullmatch(r"call_[0-9a-f]{12}", new_call_id(name))
    assert len({new_call_id("mistral") for _ in range(1000)}) == 1000
    t = P.parse('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{bad}</tool_call>')
    assert all(re.fullmatch(r"call_[0-9a-f]{12}", i.id) for i in t.items)
