"""The ``swe`` handler on a small real git repository built here (a real bug, a real pytest suite): the
patch taken from the agent's edits is applied in a fresh sandbox and FAIL_TO_PASS / PASS_TO_PASS decide."""
from __future__ import annotations

import json
import subprocess

import pytest

from handlers.swe import harness_paths, parse_junit, report_statuses

BUGGY = "def mean(xs):\n    return sum(xs) / (len(xs) + 1)\n\n\ndef total(xs):\n    return sum(xs)\n"
VISIBLE_TESTS = "from stats import total\n\n\ndef test_total():\n    assert total([1, 2, 3]) == 6\n"
HIDDEN_TESTS = ("from stats import mean, total\n\n\ndef test_mean():\n    assert mean([1, 2, 3]) == 2\n\n\n"
                "def test_total_empty():\n    assert total([]) == 0\n")


def tool_call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture
def swe_instance(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "stats.py").write_text(BUGGY)
    (repo / "tests" / "test_stats.py").write_text(VISIBLE_TESTS)
    (repo / "conftest.py").write_text("")  # puts the repo root on sys.path for pytest
    git = ["git", "-C", str(repo), "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "initial"], check=True)
    repo.chmod(0o755)
    tmp_path.chmod(0o755)
    return {"data_source": "swe", "instance_id": "stats-1", "repo": str(repo),
            "problem_statement": "mean() returns the wrong value: mean([1, 2, 3]) should be 2.",
            "test_files": {"tests/test_hidden.py": HIDDEN_TESTS},
            "FAIL_TO_PASS": ["tests/test_hidden.py::test_mean"],
            "PASS_TO_PASS": ["tests/test_hidden.py::test_total_empty", "tests/test_stats.py::test_total"]}


def test_junit_report_gives_each_node_id_its_status():
    # A report as pytest's junitxml plugin writes it (xunit2), with the node ids mangled to classname/name.
    report = b"""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.a" name="test_x" time="0.001" />
<testcase classname="tests.a" name="test_y"><failure message="assert 1 == 2">...</failure></testcase>
<testcase classname="tests.b.TestK" name="test_z[1-a::b]"><error message="fixture">...</error></testcase>
<testcase classname="tests.b" name="test_s"><skipped type="pytest.xfail" message="xfail" /></testcase>
<testcase classname="tests.b" name="test_t" />
<testcase classname="tests.b" name="test_t"><error message="teardown">...</error></testcase>
</testsuite></testsuites>"""
    ids = ["tests/a.py::test_x", "tests/a.py::test_y", "tests/b.py::TestK::test_z[1-a::b]", "tests/b.py::test_s",
           "tests/b.py::test_t", "tests/b.py::test_gone"]
    assert report_statuses(ids, parse_junit(report)) == {
        "tests/a.py::test_x": "PASSED", "tests/a.py::test_y": "FAILED", "tests/b.py::TestK::test_z[1-a::b]": "ERROR",
        "tests/b.py::test_s": "SKIPPED", "tests/b.py::test_t": "ERROR", "tests/b.py::test_gone": "MISSING"}


@pytest.mark.parametrize("doc", [b"PASSED tests/a.py::test_x", b"<html/>",
                                 b'<!DOCTYPE t [<!ENTITY a "x">]><testsuites/>', b"<testsuites>"])
def test_a_document_that_is_not_a_junit_report_is_refused(doc):
    from handlers.swe.harness import ReportError

    with pytest.raises(ReportError):
        parse_junit(doc)


def test_harness_paths_keep_source_and_take_back_everything_else():
    base = ["stats.py", "pkg/__init__.py", "pkg/m.py", "src/other/__init__.py", "tests/test_stats.py",
            "setup.cfg", "docs/index.rst"]
    touched = ["stats.py", "pkg/m.py", "pkg/new.py", "pkg/sub/__init__.py", "pkg/sub/json.py", "docs/index.rst",
               # harness:
               "conftest.py", "pkg/conftest.py", "setup.cfg", "pytest.ini", "tox.ini", "pyproject.toml",
               "sub/.pytest.ini", "tests/test_stats.py", "tests/helpers.py", "pkg/test_m.py", "tests",
               "sitecustomize.py", "pkg/usercustomize.py", "evil.pth", "x.dist-info/entry_points.txt",
               "pkg/__pycache__/m.cpython-311.pyc", "json.py", "pytest.py", "_pytest/__init__.py",
               "src/pluggy/__init__.py", "docs/new.py", ".gitattributes"]
    got = harness_paths(touched, base, ["tests/test_hidden.py"])
    assert set(got) == set(touched[6:]), got


@pytest.mark.real
async def test_scripted_fix_resolves_and_no_fix_does_not(rollout_server, scripted_policy, swe_instance,
                                                          sandbox_procs):
    def fixer(prompt: str, turn: int) -> str:
        if turn == 0:
            return tool_call("str_replace_editor", command="str_replace", path="repo/stats.py",
                             old_str="(len(xs) + 1)", new_str="len(xs)")
        if turn == 1:
            return "Let me run the tests.\n" + tool_call("bash", command="cd repo && python -m pytest -q -p no:cacheprovider")
        return tool_call("finish", answer="fixed mean")

    def idler(prompt: str, turn: int) -> str:
        return tool_call("bash", command="cd repo; ls") if turn == 0 else tool_call("finish", answer="nothing")

    for script, want in ((fixer, 1.0), (idler, 0.0)):
        client = await rollout_server([await scripted_policy(script)])
        r = await (await client.post("/process", json={"instance": swe_instance,
                                                       "sampling_params": {"max_tokens": 1024}})).json()
        assert r["critical_error"] is None, r["error"]
        ev = r["extra"]["eval"]
        assert r["reward"] == want, ev.get("output_tail", ev)
        if want == 1.0:
            assert ev["patch_applied"] and set(ev["FAIL_TO_PASS"].values()) == {"PASSED"}
            assert set(ev["PASS_TO_PASS"].values()) == {"PASSED"}
        else:
            assert ev["FAIL_TO_PASS"] == {"tests/test_hidden.py::test_mean": "FAILED"}
        assert not sandbox_procs()
    # the host repository was never modified: the agent worked on a private copy
    assert "(len(xs) + 1)" in open(swe_instance["repo"] + "/stats.py").read()


@pytest.mark.real
async def test_patch_that_does_not_apply_scores_zero(rollout_server, scripted_policy, swe_instance):
    def breaker(prompt: str, turn: int) -> str:
        if turn == 0:
            return tool_call("bash", command="cd repo && rm stats.py && git add -A")
        return tool_call("finish", answer="deleted")

    client = await rollout_server([await scripted_policy(breaker)])
    r = await (await client.post("/process", json={"instance": swe_instance, "sampling_params": {"max_tokens": 512}})).json()
    assert r["reward"] == 0.0
    assert r["extra"]["eval"]["FAIL_TO_PASS"]["tests/test_hidden.py::test_mean"] in ("FAILED", "ERROR", "MISSING")


def test_swe_instance_without_repo_is_refused_at_submit_clearly():
    from handlers.swe import SweHandler
    from prorl_server.plugin import InstanceValidationError

    with pytest.raises(InstanceValidationError, match="needs 'repo' \\(host path\\) or 'repo_path'"):
        SweHandler().prepare_instance({"data_source": "swe", "problem_statement": "fix it"})
    with pytest.raises(InstanceValidationError) as e:
        SweHandler().prepare_instance({"data_source": "swe", "repo": "/r", "FAIL_TO_PASS": "tests/t.py::a"})
    assert e.value.field == "instance.FAIL_TO_PASS"


def test_swe_instance_waiving_an_unknown_patch_check_rule_is_refused_at_submit():
    from handlers.swe import SweHandler
    from prorl_server.plugin import InstanceValidationError

    inst = {"data_source": "swe", "repo": "/r", "patch_check_allow": ["pytest_hook"]}
    assert SweHandler().prepare_instance(inst)["patch_check_allow"] == ["pytest_hook"]
    for bad in (["no_such_rule"], ["patch_too_large"]):
        with pytest.raises(InstanceValidationError) as e:
            SweHandler().prepare_instance({**inst, "patch_check_allow": bad})
        assert e.value.field.startswith("instance.patch_check_allow"), e.value.field
