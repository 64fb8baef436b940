"""Build a tiny random causal LM with a locally trained tokenizer: the test model of the LLM tier.

Nothing is downloaded. The tokenizer is a byte-level BPE (GPT-2/Qwen2 style, the ``tokenizers`` library)
trained on CPython's own standard-library sources; the model is a randomly initialised
``Qwen2ForCausalLM`` (2 layers, hidden 128, vocab 4096 by default); the chat template is ChatML with
Qwen2.5-style tool support (``tools=`` renders the JSON schemas into the system turn, tool calls are hermes
``<tool_call>{json}</tool_call>``, tool results are ``<tool_response>`` blocks in a user turn). Everything is
written with ``save_pretrained`` so ``AutoTokenizer`` / ``AutoModelForCausalLM`` / vLLM load the directory
like any hub model.

``template=`` builds a *family test model* instead: the same kind of tokenizer and weights carrying one of the
published chat templates bundled in :mod:`prorl_server.llm.chat_templates` (``qwen2_5``, ``qwen3``, ``llama3_1``,
``llama3_2``, ``mistral_v3_tekken``, ``mistral_v7_tekken``, ``gemma3``, ``deepseekv3``), with that family's
markers as single tokens and its end-of-turn token as ``eos_token`` (and the model's stop tokens).

Usage::

    python -m prorl_server.dev.tiny_model --out DIR [--force] [--template NAME]

Measured here: ~10 s on 2 cores, ~5 MB on disk.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Tool-call markers are single tokens (as in Qwen2.5) but not "special": decoding with
# skip_special_tokens=True keeps them, so a tool parser sees them in the text.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML with tool support, after Qwen2.5's template (generic default system prompt).
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def stdlib_sources(max_bytes: int) -> Iterator[str]:
    """Yield the text of CPython standard-library ``.py`` files (sorted, so the corpus is deterministic),
    skipping ``site-packages`` and test suites, until ``max_bytes`` of text have been yielded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("site-packages", "dist-packages", "test", "tests", "idlelib") for p in rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if total >= max_bytes:
            return


@lru_cache(maxsize=4)
def _trained_bpe(vocab_size: int, corpus_bytes: int) -> str:
    """The trained byte-level BPE as ``tokenizers`` JSON (trained once per process and size: every family
    test model shares it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_sources(corpus_bytes), trainer=trainer)
    return tok.to_str()


def build_tokenizer(vocab_size: int = 4096, corpus_bytes: int = 6_000_000, model_max_length: int = 16384,
                    template: Optional[str] = None):
    """Train a byte-level BPE on stdlib sources and wrap it as a ``PreTrainedTokenizerFast``.

    Args:
        template: None: the ChatML tokenizer below; else a bundled template name
            (:func:`prorl_server.llm.chat_templates.load_template`): its family's markers are added as single tokens
            (special, except the hermes tool tags and ``<think>`` tags, which Qwen keeps as plain added tokens).

    Returns:
        transformers.PreTrainedTokenizerFast. Default: ChatML special tokens, the tool-call added tokens and
        :data:`CHAT_TEMPLATE`; ``eos_token`` is ``<|im_end|>`` (the end of an assistant turn). With
        ``template``: that template, ``eos_token``/``bos_token`` its family's.

    Raises:
        ValueError: unknown ``template``.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if template is not None:
        from prorl_server.llm.chat_templates import TEMPLATE_FAMILY, family_spec, load_template

        text = load_template(template)
        spec = family_spec(TEMPLATE_FAMILY[Path(template).stem + ".jinja"])
    tok = Tokenizer.from_str(_trained_bpe(vocab_size, corpus_bytes))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>" if template is None else spec.eos,
        bos_token=None if template is None else spec.bos,
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    if template is None:
        fast.add_tokens(ADDED_TOKENS, special_tokens=False)
        fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
        fast.chat_template = CHAT_TEMPLATE
        return fast
    plain = [m for m in spec.markers if m in ADDED_TOKENS or m in ("<think>", "</think>")]
    special = [m for m in spec.markers if m not in plain and m != "<|endoftext|>"]
    fast.add_tokens(plain, special_tokens=False)
    fast.add_special_tokens({"additional_special_tokens": special})
    fast.chat_template = text
    return fast


def build_model(tokenizer, *, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                num_kv_heads: int = 2, intermediate_size: int = 256, max_position_embeddings: int = 16384,
                seed: int = 0):
    """A randomly initialised ``Qwen2ForCausalLM`` sized for ``tokenizer`` (float32, seeded)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    vocab = len(tokenizer)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in [tokenizer.eos_token, *_extra_stops(tokenizer)]]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids(tokenizer.bos_token or "<|endoftext|>"),
        eos_token_id=stops[0],
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[*stops, tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=config.pad_token_id,
    )
    return model


def _extra_stops(tokenizer) -> list[str]:
    """Tokens besides ``eos_token`` that end a turn in the tokenizer's template family (Llama's ``<|eom_id|>``)."""
    from prorl_server.llm.chat_templates import detect_family, family_spec

    spec = family_spec(detect_family(tokenizer.chat_template))
    return [t for t in spec.extra_stop if t in tokenizer.get_vocab()]


def build(out: os.PathLike | str, *, force: bool = False, vocab_size: int = 4096,
          max_position_embeddings: int = 16384, template: Optional[str] = None) -> Path:
    """Build the tiny model + tokenizer into ``out`` (reused if a complete build is already there).

    ``template``: a bundled chat template name for a family test model (see :func:`build_tokenizer`).

    Returns:
        The output directory. A ``prorl_tiny_model.json`` marker with the build parameters is written last, so
        a half-written directory is rebuilt.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    marker = out / "prorl_tiny_model.json"
    params = {"vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings, "format": 1}
    if template is not None:
        params["template"] = template
    if not force and marker.exists():
        try:
            if json.loads(marker.read_text()) == params:
                return out
        except (ValueError, OSError):
            pass
    t0 = time.monotonic()
    tokenizer = build_tokenizer(vocab_size=vocab_size, model_max_length=max_position_embeddings, template=template)
    model = build_model(tokenizer, max_position_embeddings=max_position_embeddings)
    # A new directory appears atomically (built aside, then renamed), so concurrent test sessions sharing
    # a cache directory never load a half-written model; an existing directory is overwritten in place.
    target = out if out.exists() else Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tokenizer.save_pretrained(target)
    model.save_pretrained(target)
    (target / marker.name).write_text(json.dumps(params))
    if target != out:
        os.chmod(target, 0o755)  # mkdtemp makes it private
        try:
            os.rename(target, out)
        except OSError:  # another process finished first: use its build
            shutil.rmtree(target, ignore_errors=True)
    log.info("built tiny model in %s in %.1f s", out, time.monotonic() - t0)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--max-position-embeddings", type=int, default=16384)
    ap.add_argument("--template", default=None, help="bundled chat template of a family test model (e.g. qwen3)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.monotonic()
    path = build(args.out, force=args.force, vocab_size=args.vocab_size,
                 max_position_embeddings=args.max_position_embeddings, template=args.template)
    print(f"{path} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
