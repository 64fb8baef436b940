"""verl's ``use_prefix_grouper`` with this plugin (#34 part 4, trainer_plugins/verl/prefix_grouper.py): each group
is checked for byte-identical, contiguous prompts, and the flag is refused with its reason while verl 0.9.1's
workers do not forward with it (a fact read from the installed verl, checked here so the refusal is revisited
when verl wires it)."""
from __future__ import annotations

from pathlib import Path

import pytest

from trainer_plugins.verl.prefix_grouper import prefix_group_refusals, prefix_grouper_refusal


def test_groups_with_identical_prompts_pass_and_a_split_row_is_refused_with_its_position():
    p = [1, 2, 3, 4]
    assert prefix_group_refusals(["a", "a", "b", "b"], [p, p, [9], [9]]) == {}
    # one job's second row: the template dropped past reasoning, so its prompt is another rendering
    refused = prefix_group_refusals(["a", "a", "a"], [p, p, [1, 2, 7, 4, 5]])
    assert set(refused) == {"a"} and "row 2" in refused["a"] and "position 2" in refused["a"]
    assert "position 4" in prefix_group_refusals(["a", "a"], [p, p + [5]])["a"]  # a longer prompt


def test_a_group_split_across_the_batch_is_refused():
    refused = prefix_group_refusals(["a", "b", "a"], [[1], [2], [1]])
    assert set(refused) == {"a"} and "not contiguous" in refused["a"]


def test_the_flag_is_refused_with_its_reason():
    from omegaconf import OmegaConf

    on = OmegaConf.create({"actor_rollout_ref": {"actor": {"use_prefix_grouper": True}}})
    off = OmegaConf.create({"actor_rollout_ref": {"actor": {"use_prefix_grouper": False}}})
    assert "refused" in prefix_grouper_refusal(on) and prefix_grouper_refusal(off) is None


def test_verl_0_9_1_workers_do_not_forward_with_the_prefix_grouper():
    verl = pytest.importorskip("verl")
    workers = Path(verl.__file__).parent / "workers"
    users = [p for p in workers.rglob("*.py") if "prefix_grouper_utils" in p.read_text()
             or "use_prefix_grouper=" in p.read_text()]
    assert users == [], f"verl's workers now forward with the prefix grouper ({users}): revisit the refusal"


def test_the_agent_loop_refuses_the_flag_at_start(compose_verl, tokenizer, monkeypatch):
    pytest.importorskip("verl")
    import importlib.util

    from omegaconf import OmegaConf
    from verl.experimental.agent_loop import agent_loop as verl_agent_loop
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import resolve_config_path

    spec = importlib.util.spec_from_file_location("_verl_plugin_helpers", Path(__file__).with_name("test_verl_plugin.py"))
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    for flag, refused in [(False, False), (True, True)]:
        cfg = compose_verl("prorl_dapo", f"actor_rollout_ref.actor.use_prefix_grouper={flag}", prompt_length=64,
                           response_length=16)
        rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
        for entry in OmegaConf.load(resolve_config_path(rollout.agent.agent_loop_config_path)):
            monkeypatch.setitem(verl_agent_loop._agent_loop_registry, entry.name, entry)
        if refused:
            with pytest.raises(Exception, match="use_prefix_grouper=True is refused"):
                helpers.make_loop(cfg, tokenizer, servers="http://127.0.0.1:9")
        else:
            helpers.make_loop(cfg, tokenizer, servers="http://127.0.0.1:9")
