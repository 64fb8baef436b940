"""Model families: which chat template a tokenizer carries and the continuation rules that keep its tokens true.

A *family* is a chat-template dialect (ChatML/Qwen2.5, Qwen3, Llama 3.x, Mistral tekken, Gemma, DeepSeek).
:func:`detect_family` names it from the template text (or take an explicit setting); :data:`FAMILIES` says
what the family's template does to a generated turn when the conversation is rendered again and which
special tokens it needs as single tokens. :class:`prorl_server.llm.conversation.Conversation` uses it to keep a
multi-turn rollout one trajectory:

- **exact**: the template re-renders the latest generated turn verbatim; the appended delta is the canonical
  rendering's text after it (the final token ids equal the full canonical rendering);
- **continued**: the template *normalises* the turn when rendering it again (Qwen3's ``<think>`` spacing and
  the empty ``<think>\\n\\n</think>\\n\\n`` that ``enable_thinking=False`` puts in the generation prompt but
  not in the re-rendered turn, Llama 3.x / Gemma ``| trim``). The generated tokens stay as generated; the
  appended delta is the rest of the turn's terminator (what the template writes after an assistant message
  that the model did not generate, e.g. ChatML's ``"\\n"`` after ``<|im_end|>``) followed by the new
  messages rendered after a synthetic assistant turn that every template renders the same way whether it is
  last or not (one tool call per tool message, non-empty ``reasoning_content``), ending with the generation
  prompt;
- **split**: the template drops text the model generated (past reasoning: Qwen3 once a new user message
  arrives, DeepSeek-R1-style ``content.split('</think>')[-1]``) or changes text before the latest turn
  (Mistral moves ``[AVAILABLE_TOOLS]`` to the last user message): the segment ends with a reason.

The continued delta matches verl's Continuous Token builders
(``verl.utils.tokenizer.continuous_token``: ``ContinuousTokenBuilder`` renders appended messages after a
synthetic system/user/assistant context and diffs; ``QwenContinuousTokenBuilder`` inserts the ``"\\n"``
after a generated ``<|im_end|>``; ``DeepSeekContinuousTokenBuilder`` concatenates directly). They are matched,
not imported: importing verl pulls torch and ray (~25 s here), which the server core must not need, and they
work on token ids of a synthetic context while the exact path here works on the real head's text, so one
rendering serves both. :data:`FamilySpec.verl_family` names the builder each family corresponds to, and the
fast tests compare the deltas with verl's where verl is installed.

Template data (``templates/*.jinja``) is each family's published template, byte for byte:

========================  ==================================================================================
file                      source
========================  ==================================================================================
qwen2_5.jinja             trl 1.16 ``trl/chat_templates/qwen2_5.jinja`` (Qwen2.5 instruct)
qwen3.jinja               trl 1.16 ``trl/chat_templates/qwen3.jinja`` (Qwen3)
llama3_1.jinja            trl 1.16 ``trl/chat_templates/llama3_1.jinja`` (Llama 3.1; Llama 3.3 ships the same)
llama3_2.jinja            trl 1.16 ``trl/chat_templates/llama3_2.jinja`` (Llama 3.2)
gemma3.jinja              trl 1.16 ``trl/chat_templates/gemma3.jinja`` (Gemma 3)
deepseekv3.jinja          trl 1.16 ``trl/chat_templates/deepseekv3.jinja`` (DeepSeek-V3)
mistral_v3_tekken.jinja   mistral_common 1.13 ``generate_chat_template(spm=False, TokenizerVersion.v3, ...)``
mistral_v7_tekken.jinja   mistral_common 1.13 ``generate_chat_template(spm=False, TokenizerVersion.v7, ...)``
========================  ==================================================================================
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"


@dataclass(frozen=True)
class FamilySpec:
    """What the conversation and the tiny test models need to know about one family.

    Attributes:
        name: the family's name (``detect_family`` result, ``Conversation(family=...)`` setting).
        verl_family: the verl Continuous Token builder family this matches (``"default"`` = the generic one).
        eos: the token ending an assistant turn (the model's stop token).
        bos: the beginning-of-sequence token the template writes (``bos_token``), if any.
        markers: the template's special tokens; each must be a single token.
        extra_stop: other tokens that also end a turn (Llama 3.x ``<|eom_id|>``, ``<|end_of_text|>``).
        tool_role: the role tool observations are sent as (Gemma has no tool role: ``"user"``).
        rewrites_history: what the template rewrites (splits), for the README and reports; None: nothing.
        templates: bundled template files of this family (first: the default for test models).
        tool_parser: the :mod:`prorl_server.llm.tool_parser` name that reads this family's tool calls (what the
            ``auto`` parser setting picks). Gemma 3 has no tool-call format of its own (its template renders
            neither tools nor calls): ``hermes``, the format agents fine-tuned on it are usually taught, and
            the one parser that needs no vLLM; ``generic`` (an unknown template) gets ``hermes`` too.
    """

    name: str
    verl_family: str
    eos: str
    bos: Optional[str] = None
    markers: tuple[str, ...] = ()
    extra_stop: tuple[str, ...] = ()
    tool_role: str = "tool"
    rewrites_history: Optional[str] = None
    templates: tuple[str, ...] = field(default_factory=tuple)
    tool_parser: str = "hermes"


_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_HERMES = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

FAMILIES: dict[str, FamilySpec] = {
    "chatml": FamilySpec("chatml", "qwen", eos="<|im_end|>", markers=_CHATML + _HERMES,
                         templates=("qwen2_5.jinja",)),
    "qwen3": FamilySpec("qwen3", "qwen3", eos="<|im_end|>", markers=_CHATML + _HERMES + ("<think>", "</think>"),
                        rewrites_history="drops the reasoning of assistant turns before the last user message",
                        templates=("qwen3.jinja",)),
    "llama3": FamilySpec("llama3", "default", eos="<|eot_id|>", bos="<|begin_of_text|>",
                         markers=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                  "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
                         extra_stop=("<|eom_id|>", "<|end_of_text|>"),
                         templates=("llama3_1.jinja", "llama3_2.jinja"), tool_parser="llama3_json"),
    "mistral": FamilySpec("mistral", "default", eos="</s>", bos="<s>",
                          markers=("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CONTENT]", "[TOOL_CALLS]",
                                   "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
                          rewrites_history="moves [AVAILABLE_TOOLS] before the last user message",
                          templates=("mistral_v7_tekken.jinja", "mistral_v3_tekken.jinja"), tool_parser="mistral"),
    "gemma": FamilySpec("gemma", "default", eos="<end_of_turn>", bos="<bos>",
                        markers=("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), extra_stop=("<eos>",),
                        tool_role="user", templates=("gemma3.jinja",)),
    "deepseek": FamilySpec("deepseek", "deepseek", eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>",
                           markers=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                                    "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
                                    "<think>", "</think>"),
                           rewrites_history="drops reasoning (text up to </think>) of an assistant turn that "
                                            "follows a user message",
                           templates=("deepseekv3.jinja",), tool_parser="deepseek_v3"),
    "generic": FamilySpec("generic", "default", eos=""),
}

# Template file -> family (the test models' ``template`` option).
TEMPLATE_FAMILY: dict[str, str] = {t: f.name for f in FAMILIES.values() for t in f.templates}


def detect_family(chat_template: Optional[str]) -> str:
    """The family of a chat template, from the markers it writes.

    Args:
        chat_template: the template text (``tokenizer.chat_template``); None or unknown markers -> ``"generic"``.

    Returns:
        A key of :data:`FAMILIES`. Qwen3 is ChatML with ``<think>`` handling (``reasoning_content``).
    """
    t = chat_template or ""
    if "<|im_start|>" in t:
        return "qwen3" if ("reasoning_content" in t or "enable_thinking" in t) else "chatml"
    if "<|start_header_id|>" in t:
        return "llama3"
    if "[INST]" in t:
        return "mistral"
    if "<start_of_turn>" in t:
        return "gemma"
    if "<｜Assistant｜>" in t:
        return "deepseek"
    return "generic"


def family_spec(family: str) -> FamilySpec:
    """The :class:`FamilySpec` named ``family``. Raises ValueError naming the known ones."""
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(FAMILIES)}") from None


@lru_cache(maxsize=None)
def load_template(name: str) -> str:
    """The text of a bundled template (``"qwen3"`` or ``"qwen3.jinja"``). Raises ValueError if there is none."""
    file = name if name.endswith(".jinja") else f"{name}.jinja"
    path = TEMPLATE_DIR / file
    if not re.fullmatch(r"[A-Za-z0-9_]+\.jinja", file) or not path.is_file():
        known = sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))
        raise ValueError(f"no bundled chat template {name!r}; known: {known}")
    return path.read_text(encoding="utf-8")


def synthetic_assistant(new: list[dict[str, Any]], max_calls: Optional[int] = None) -> dict[str, Any]:
    """An assistant turn rendered before ``new`` when only ``new``'s rendering is wanted (verl's
    ``ContinuousTokenBuilder._synthetic_assistant_for_tools``): non-empty content and ``reasoning_content``
    (templates render such a turn the same whether it is last or not), one tool call per leading tool message
    (``max_calls`` caps them: Llama 3.1 allows one), with the ids the tool messages refer to and arguments as
    a JSON string (DeepSeek concatenates it)."""
    calls = []
    for i, m in enumerate(new):
        if m.get("role") != "tool" or (max_calls is not None and len(calls) >= max_calls):
            break
        calls.append({"id": str(m.get("tool_call_id") or m.get("call_id") or f"call{i:05d}"), "type": "function",
                      "function": {"name": str(m.get("name") or "tool"), "arguments": "{}"}})
    msg: dict[str, Any] = {"role": "assistant", "content": "synthetic", "reasoning_content": "reasoning"}
    if calls:
        msg["tool_calls"] = calls
    return msg
