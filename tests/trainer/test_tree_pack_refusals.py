"""Models whose forward tree packing cannot reproduce are refused before any packed forward (#34, red team rows
4 and 5; trainer_plugins/trl/tree_pack.py ``packing_refusal``): sliding-window attention (the packed forward
attends to every ancestor token, off by 0.13-0.82 once a row is longer than the window, while a short first
batch passed the self-check) and attention implementations other than SDPA and eager (flex_attention's packed
forward aborted the process). A window that is configured but used by no layer is not refused. Tiny configs
built here, no download."""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.trainer import test_tree_pack  # noqa: E402
from trainer_plugins.trl import tree_pack  # noqa: E402
from trainer_plugins.trl.tree_pack import TreePackedLogps, packing_refusal  # noqa: E402

SMALL = dict(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)


def tiny(config_cls, impl: str = "sdpa", **kw):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config_cls(**SMALL, **kw), attn_implementation=impl,
                                                         dtype=torch.float32).eval()


@pytest.mark.parametrize("name,build,refused", [
    ("qwen2 every layer sliding", lambda: tiny(transformers.Qwen2Config, use_sliding_window=True,
                                               sliding_window=16, max_window_layers=0), "sliding_attention"),
    ("qwen2 upper layer sliding", lambda: tiny(transformers.Qwen2Config, use_sliding_window=True,
                                               sliding_window=16, max_window_layers=1), "sliding_attention"),
    ("mistral window on every layer", lambda: tiny(transformers.MistralConfig, sliding_window=16),
     "sliding window of 16"),
    ("gemma2 alternating layers", lambda: tiny(transformers.Gemma2Config, head_dim=16, sliding_window=16),
     "sliding_attention"),
    # a window configured but used by no layer, as transformers builds the layers
    ("qwen2 use_sliding_window off", lambda: tiny(transformers.Qwen2Config, use_sliding_window=False,
                                                  sliding_window=16, max_window_layers=0), None),
    ("qwen2 window above every layer", lambda: tiny(transformers.Qwen2Config, use_sliding_window=True,
                                                    sliding_window=16, max_window_layers=2), None),
    ("mistral without a window", lambda: tiny(transformers.MistralConfig, sliding_window=None), None),
])
def test_a_model_is_refused_exactly_when_a_layer_uses_a_sliding_window(name, build, refused):
    model = build()
    reason = packing_refusal(model)
    if refused is None:
        assert reason is None, name
    else:
        assert reason is not None and refused in reason and model.config.model_type in reason, (name, reason)
        with pytest.raises(ValueError, match="cannot tree-pack"):  # the packed forward itself refuses too
            tree_pack.packed_row_logprobs(model, tree_pack.pack(*tree_pack.build_prefix_tree([[5, 6, 7], [5, 6]])))


class PerRowTrainer(test_tree_pack.PerRowTrainer):
    """test_tree_pack's stand-in for TRL's per-row forward, counting its calls."""

    calls = 0

    def _get_per_token_logps_and_entropies(self, *a, **kw):
        self.calls += 1
        return super()._get_per_token_logps_and_entropies(*a, **kw)


class PackedTrainer(TreePackedLogps, PerRowTrainer):
    pass


def batch(prompt_len: int, completion_len: int, rows: int = 4, seed: int = 0):
    """A group: one shared prompt, ``rows`` completions (TRL's layout, no padding needed)."""
    rnd = random.Random(seed)
    prompt = [rnd.randrange(10, 4000) for _ in range(prompt_len)]
    ids = torch.tensor([prompt + [rnd.randrange(10, 4000) for _ in range(completion_len)] for _ in range(rows)])
    return ids, torch.ones_like(ids), completion_len


def test_a_sliding_window_model_is_forwarded_per_row_from_its_short_first_batch_on(monkeypatch):
    """The red team's case: a short first batch (every row inside the window) passed the self-check, and the
    long batches after it trained on logprobs off by 0.27. Now no batch is packed, the reason names the window
    and the model type, and every batch is counted."""
    model = tiny(transformers.Qwen2Config, use_sliding_window=True, sliding_window=16, max_window_layers=0)

    def packed(*a, **k):
        raise AssertionError("a packed forward of a sliding-window model")

    monkeypatch.setattr(tree_pack, "tree_packed_batch", packed)
    trainer = PackedTrainer()
    with torch.no_grad():
        for prompt_len, completion_len in [(6, 4), (40, 20)]:  # inside the window, then far beyond it
            ids, mask, C = batch(prompt_len, completion_len)
            got, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C)
            assert torch.equal(got, PerRowTrainer()._get_per_token_logps_and_entropies(model, ids, mask, C)[0])
    s = trainer.tree_pack_stats
    assert s.packed_batches == 0 and s.row_batches == 2 and s.self_check_delta is None
    assert "qwen2" in s.fallback_reason and "sliding_window=16" in s.fallback_reason
    assert sum(s.reasons.values()) == 2


def test_a_configured_but_unused_window_still_packs():
    model = tiny(transformers.Qwen2Config, use_sliding_window=False, sliding_window=16, max_window_layers=0)
    ids, mask, C = batch(40, 20)
    trainer = PackedTrainer()
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(model, ids, mask, C)
    s = trainer.tree_pack_stats
    assert s.fallback_reason is None and s.packed_batches == 1 and s.self_check_delta <= 1e-5


def test_a_flex_attention_model_falls_back_before_any_packed_forward(tiny_model_dir, monkeypatch):
    """flex_attention's packed forward aborted the trainer (rc 139, ``malloc(): invalid size``): the mixin now
    refuses it from its config, without a packed forward (one would fail the test here, not crash it) and
    without a per-row forward of its own (the stand-in for TRL's forward returns zeros, runs nothing)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="flex_attention",
                                                              dtype=torch.float32).eval()

    def packed(*a, **k):
        raise AssertionError("a packed forward of a flex_attention model")

    monkeypatch.setattr(tree_pack, "tree_packed_batch", packed)
    monkeypatch.setattr(tree_pack, "packed_row_logprobs", packed)

    class NoForward:  # stands for TRL's per-row forward, which this test does not need to run
        calls = 0

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kw):
            self.calls += 1
            return torch.zeros(input_ids.size(0), logits_to_keep), None, None

    class Trainer(TreePackedLogps, NoForward):
        pass

    trainer = Trainer()
    ids, mask, C = batch(30, 8)
    trainer._get_per_token_logps_and_entropies(model, ids, mask, C)
    s = trainer.tree_pack_stats
    assert trainer.calls == 1 and s.row_batches == 1 and s.packed_batches == 0
    assert "flex_attention" in s.fallback_reason and "qwen2" in s.fallback_reason
    assert model.config._attn_implementation == "flex_attention"  # left as it was
