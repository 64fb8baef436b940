"""Build a tiny random causal LM with a locally trained tokenizer: the test model of the LLM tier.

Nothing is downloaded. The tokenizer is a byte-level BPE (GPT-2/Qwen2 style, the ``tokenizers`` library)
trained on CPython's own standard-library sources; the model is a randomly initialised
``Qwen2ForCausalLM`` (2 layers, hidden 128, vocab 4096 by default); the chat template is ChatML with
Qwen2.5-style tool support (``tools=`` renders the JSON schemas into the system turn, tool calls are hermes
``<tool_call>{json}</tool_call>``, tool results are ``<tool_response>`` blocks in a user turn). Everything is
written with ``save_pretrained`` so ``AutoTokenizer`` / ``AutoModelForCausalLM`` / vLLM load the directory
like any hub model.

Usage::

    python -m prorl_server.tiny_model --out DIR [--force]

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


def build_tokenizer(vocab_size: int = 4096, corpus_bytes: int = 6_000_000, model_max_length: int = 16384):
    """Train a byte-level BPE on stdlib sources and wrap it as a ``PreTrainedTokenizerFast``.

    Returns:
        transformers.PreTrainedTokenizerFast with ChatML special tokens, the tool-call added tokens and
        :data:`CHAT_TEMPLATE`; ``eos_token`` is ``<|im_end|>`` (the end of an assistant turn).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(ADDED_TOKENS, special_tokens=False)
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer, *, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                num_kv_heads: int = 2, intermediate_size: int = 256, max_position_embeddings: int = 16384,
                seed: int = 0):
    """A randomly initialised ``Qwen2ForCausalLM`` sized for ``tokenizer`` (float32, seeded)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    vocab = len(tokenizer)
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
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, config.bos_token_id],
        pad_token_id=config.pad_token_id,
    )
    return model


def build(out: os.PathLike | str, *, force: bool = False, vocab_size: int = 4096,
          max_position_embeddings: int = 16384) -> Path:
    """Build the tiny model + tokenizer into ``out`` (reused if a complete build is already there).

    Returns:
        The output directory. A ``prorl_tiny_model.json`` marker with the build parameters is written last, so
        a half-written directory is rebuilt.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    marker = out / "prorl_tiny_model.json"
    params = {"vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings, "format": 1}
    if not force and marker.exists():
        try:
            if json.loads(marker.read_text()) == params:
                return out
        except (ValueError, OSError):
            pass
    t0 = time.monotonic()
    tokenizer = build_tokenizer(vocab_size=vocab_size, model_max_length=max_position_embeddings)
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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.monotonic()
    path = build(args.out, force=args.force, vocab_size=args.vocab_size,
                 max_position_embeddings=args.max_position_embeddings)
    print(f"{path} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
