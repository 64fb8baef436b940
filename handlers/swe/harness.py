"""The SWE handler's clean test harness: which paths of a patch are harness (restored from the base commit
before the tests run), and the verdict from pytest's JUnit XML report (never from its output).

The rule is an allow-list of what a patch may change: the repository's source. Everything that decides how
the tests run is harness and comes from the base commit, whatever the patch did to it:

- the tests themselves: the files the instance names (FAIL_TO_PASS / PASS_TO_PASS ids, ``test_files``,
  ``test_patch``) and every directory on the way to them, any path inside a ``test``/``tests``/``testing``
  directory, and test modules (``test_*.py``, ``*_test.py``, ``tests.py``, ``test.py``);
- test configuration: every ``conftest.py`` and pytest/tox/setuptools/coverage configuration file
  (``pytest.ini``, ``.pytest.ini``, ``pytest.toml``, ``.pytest.toml``, ``tox.ini``, ``setup.cfg``,
  ``pyproject.toml``, ``.coveragerc``) anywhere, and ``.gitattributes`` (it steers how git restores files);
- import-time hooks: ``sitecustomize.py``, ``usercustomize.py``, ``*.pth``, ``*.egg-link``, package metadata
  (``*.dist-info/``, ``*.egg-info/``: entry points load pytest plugins), byte code (``__pycache__/``,
  ``*.pyc``, ``*.pyo``: an unchecked-hash ``.pyc`` runs instead of its source) and test caches
  (``.pytest_cache/``, ``.hypothesis/``);
- files the patch ADDS outside a package: a new path whose nearest directory of the base commit is the
  repository root or has no ``__init__.py`` there. Such a directory may be on ``sys.path`` (``python -m``
  puts the working directory first, pytest's rootdir insertion adds test directories, an editable install
  adds the root or ``src/``), so a module added there (``pytest.py``, ``_pytest/``, ``pluggy/``,
  ``json.py``, ...) would shadow the one the test run imports. New modules inside an existing package are
  source and kept.

Harness paths the patch added are deleted; those it changed or deleted are checked out from the base commit.
"""
from __future__ import annotations

import fnmatch
import os
import stat
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from typing import Optional

TEST_DIRS = frozenset({"test", "tests", "testing"})
TEST_MODULES = ("test_*.py", "*_test.py", "tests.py", "test.py")
CONFIG_FILES = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini",
                          "setup.cfg", "pyproject.toml", ".coveragerc", ".gitattributes"})
IMPORT_HOOK_FILES = frozenset({"sitecustomize.py", "usercustomize.py"})
IMPORT_HOOK_SUFFIXES = (".pth", ".egg-link", ".pyc", ".pyo")
METADATA_DIR_SUFFIXES = (".dist-info", ".egg-info")
CACHE_DIRS = frozenset({"__pycache__", ".pytest_cache", ".hypothesis"})

#: Largest JUnit report read back (bytes); a bigger one counts as no report.
MAX_REPORT_BYTES = 32 << 20

PASSED, FAILED, ERROR, SKIPPED, MISSING = "PASSED", "FAILED", "ERROR", "SKIPPED", "MISSING"
# When one test id has several <testcase> entries (a teardown error, a re-run plugin), the worst one counts.
_RANK = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}


class ReportError(ValueError):
    """The JUnit report is missing, too large, not a regular file, or not a pytest JUnit document."""


# ----------------------------------------------------------------------------------------- which paths
def file_of_test(test_id: str) -> str:
    """The file part of a pytest node id: ``"tests/t.py::TestA::test_b[1]"`` -> ``"tests/t.py"``."""
    return test_id.partition("::")[0]


def harness_reason(path: str, *, added: bool, base_files: frozenset[str], base_dirs: frozenset[str],
                   named: frozenset[str]) -> Optional[str]:
    """Why ``path`` (repository-relative, ``/``-separated, as git prints it) is harness, or ``None`` when it
    is source the patch may change. ``added``: the path is not in the base commit. ``base_files`` /
    ``base_dirs``: every file / directory of the base commit (``""`` is the root). ``named``: the test
    files the instance names. See the module docstring for the rules."""
    parts = path.split("/")
    name = parts[-1]
    if path in named or any(n.startswith(path + "/") for n in named):
        return "a test file the instance names, or a directory on its way"
    if name in CONFIG_FILES:
        return "test configuration"
    if (name in IMPORT_HOOK_FILES or name.endswith(IMPORT_HOOK_SUFFIXES)
            or any(p in CACHE_DIRS or p.endswith(METADATA_DIR_SUFFIXES) for p in parts)):
        return "import-time hook, package metadata or byte code"
    if any(p in TEST_DIRS for p in parts[:-1]) or any(fnmatch.fnmatchcase(name, pat) for pat in TEST_MODULES):
        return "test code"
    if added:
        parent = ""
        for i in range(len(parts) - 1, 0, -1):
            d = "/".join(parts[:i])
            if d in base_dirs:
                parent = d
                break
        if parent == "" or f"{parent}/__init__.py" not in base_files:
            return "added outside a package (it could shadow a module the test run imports)"
    return None


def base_tree(files: Iterable[str]) -> tuple[frozenset[str], frozenset[str]]:
    """(files, directories) of a commit from its file list (``git ls-tree -r --name-only``)."""
    fs = frozenset(files)
    dirs = {""}
    for f in fs:
        parts = f.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return fs, frozenset(dirs)


def harness_paths(touched: Iterable[str], base_files: Iterable[str], named: Iterable[str]) -> dict[str, str]:
    """The touched paths that are harness, each with its reason (see :func:`harness_reason`).

    Args:
        touched: every path the patch changed, added or deleted.
        base_files: every file of the base commit.
        named: the test files the instance names (repository-relative).
    """
    files, dirs = base_tree(base_files)
    named_set = frozenset(os.path.normpath(n).replace(os.sep, "/") for n in named)
    out = {}
    for p in touched:
        reason = harness_reason(p, added=p not in files and p not in dirs, base_files=files, base_dirs=dirs,
                                named=named_set)
        if reason:
            out[p] = reason
    return out


def parse_nul_list(data: bytes) -> list[str]:
    """Paths from ``-z`` output (NUL-separated), decoded as git writes them (UTF-8, surrogate escapes)."""
    return [p.decode("utf-8", "surrogateescape") for p in data.split(b"\0") if p]


def parse_numstat(data: bytes) -> list[str]:
    """Paths from ``git apply --numstat -z``: ``added\\tdeleted\\tpath\\0`` per file, or for a copy or
    rename ``added\\tdeleted\\t\\0src\\0dst\\0`` (both kept)."""
    out, items, i = [], data.split(b"\0"), 0
    while i < len(items):
        item = items[i]
        i += 1
        if not item:
            continue
        fields = item.split(b"\t", 2)
        if len(fields) != 3:
            continue
        if fields[2]:
            out.append(fields[2])
        else:
            out.extend(items[i:i + 2])
            i += 2
    return [p.decode("utf-8", "surrogateescape") for p in out if p]


def parse_status(data: bytes) -> set[str]:
    """Entries of ``git status --porcelain=v1 -z --no-renames`` (``XY path``), kept whole, so the entries
    before and after the patch can be compared."""
    return {e.decode("utf-8", "surrogateescape") for e in data.split(b"\0") if e}


# ----------------------------------------------------------------------------------------- the verdict
def junit_key(test_id: str) -> tuple[str, str]:
    """``(classname, name)`` of a pytest node id as pytest's ``junitxml`` plugin writes it (its
    ``mangle_test_address``; no ``junit_prefix``): ``"tests/t.py::TestA::test_b[x]"`` ->
    ``("tests.t.TestA", "test_b[x]")``."""
    path, sep, tail = test_id.partition("::")
    module = path.replace("/", ".")
    module = module[:-3] if module.endswith(".py") else module
    if not sep:
        return "", module
    name_part, bracket, params = tail.partition("[")
    names = [module, *name_part.split("::")]
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def parse_junit(data: bytes) -> dict[tuple[str, str], str]:
    """``(classname, name) -> status`` from a pytest JUnit XML report (``xunit1`` or ``xunit2``).

    A ``<testcase>`` with a ``<failure>`` child is FAILED, with ``<error>`` ERROR, with ``<skipped>`` (skips
    and xfails) SKIPPED, with none of them PASSED; repeated entries keep the worst. Raises
    :class:`ReportError` for a document that is too large, declares a DTD or entities (pytest never does), is
    not well-formed XML, or whose root is not ``<testsuites>``/``<testsuite>``."""
    if len(data) > MAX_REPORT_BYTES:
        raise ReportError(f"the report has {len(data)} bytes, more than {MAX_REPORT_BYTES}")
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise ReportError("the report declares a DTD or entities")
    try:
        root = ET.fromstring(data)
    except ET.ParseError as e:
        raise ReportError(f"the report is not well-formed XML: {e}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ReportError(f"the report's root element is <{root.tag}>, not <testsuites>")
    out: dict[tuple[str, str], str] = {}
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        status = (ERROR if "error" in tags else FAILED if "failure" in tags
                  else SKIPPED if "skipped" in tags else PASSED)
        key = (case.get("classname", ""), case.get("name", ""))
        if key not in out or _RANK[status] > _RANK[out[key]]:
            out[key] = status
    return out


def report_statuses(test_ids: Iterable[str], report: dict[tuple[str, str], str]) -> dict[str, str]:
    """Status of each test id in a parsed report; an id the report does not have is MISSING."""
    return {t: report.get(junit_key(t), MISSING) for t in test_ids}


def report_verdict(workspace: str, relpath: str, fail_to_pass: list[str], pass_to_pass: list[str]
                   ) -> tuple[dict[str, str], dict[str, str], bool]:
    """Read and parse the JUnit report at ``relpath`` under ``workspace`` (:func:`read_report`,
    :func:`parse_junit`) and return ``(FAIL_TO_PASS statuses, PASS_TO_PASS statuses, any_failed)``, where
    ``any_failed`` says whether any ``<testcase>`` of the report failed or errored.

    The report is shaped by the code under test (test names, exception messages of up to
    :data:`MAX_REPORT_BYTES`), so the SWE handler runs this in the server's CPU pool, never on the event loop
    (an 8 MB message cost 0.36 s of parsing there, a stall of every job). Only the statuses of the instance's
    own test ids travel back, so what is pickled back is bounded by the instance, not by the report.
    Raises :class:`ReportError`."""
    report = parse_junit(read_report(workspace, relpath))
    return (report_statuses(fail_to_pass, report), report_statuses(pass_to_pass, report),
            any(st in (FAILED, ERROR) for st in report.values()))


def read_report(workspace: str, relpath: str, max_bytes: int = MAX_REPORT_BYTES) -> bytes:
    """Read the report at ``relpath`` under the host directory ``workspace`` without following any symlink
    the sandbox may have planted on the way (each component opened with ``O_NOFOLLOW`` relative to its
    parent) and only if it is a regular file of at most ``max_bytes``. Raises :class:`ReportError`."""
    parts = [p for p in relpath.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ReportError(f"bad report path {relpath!r}")
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise ReportError(f"the workspace {workspace} cannot be opened: {e.strerror}") from None
    try:
        for p in parts[:-1]:
            nxt = os.open(p, os.O_RDONLY | os.O_DIRECTORY | nofollow, dir_fd=fd)
            os.close(fd)
            fd = nxt
        ffd = os.open(parts[-1], os.O_RDONLY | os.O_NONBLOCK | nofollow, dir_fd=fd)
    except OSError as e:
        raise ReportError(f"no report at {relpath}: {e.strerror}") from None
    finally:
        os.close(fd)
    with os.fdopen(ffd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ReportError(f"the report {relpath} is not a regular file")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ReportError(f"the report {relpath} is larger than {max_bytes} bytes")
    return data
