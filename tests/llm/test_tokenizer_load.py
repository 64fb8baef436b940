"""The first tokenizer load imports transformers and torch (~370k objects) in a worker thread; the cyclic
collector is off meanwhile, so no collection walks the half-imported modules while the event loop waits for
the GIL (issue #26), and it is on again afterwards whatever the load did."""
from __future__ import annotations

import gc

import pytest

from prorl_server.llm import context


def test_the_collector_is_off_while_a_tokenizer_loads_and_as_before_afterwards(monkeypatch):
    seen = []

    def load(name, local_only):
        seen.append(gc.isenabled())
        if name == "missing":
            raise context.TokenizerUnavailableError("not here")
        return object()

    monkeypatch.setattr(context, "_load", load)
    assert gc.isenabled()
    context._load_tokenizer("tiny")
    with pytest.raises(context.TokenizerUnavailableError):
        context._load_tokenizer("missing")
    assert seen == [False, False] and gc.isenabled()
    gc.disable()  # a process that runs without the collector keeps it off
    try:
        context._load_tokenizer("tiny")
        assert not gc.isenabled()
    finally:
        gc.enable()
