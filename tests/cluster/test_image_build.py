"""prorl-build-image (`singularity/build.py`): rendering, Dockerfile conversion, cache keys and decisions, the
exact build command.

Apptainer cannot be installed on the CI machines: builds run through tests/cluster/fake_apptainer.py (which
stands for `apptainer build`); the one real build test runs only where a builder binary exists.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from singularity import build as ib

REPO = Path(__file__).resolve().parents[2]
FAKE_BUILDER = Path(__file__).resolve().parent / "fake_apptainer.py"


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture
def project(tmp_path) -> Path:
    """A minimal installable project (stands for this checkout, so edits do not touch the real one)."""
    root = tmp_path / "project"
    (root / "sandbox").mkdir(parents=True)
    (root / "setup.cfg").write_text("[metadata]\nname = prorl-server\nversion = 1.2.3\n")
    (root / "pyproject.toml").write_text("[build-system]\nrequires = ['setuptools']\n")
    (root / "sandbox" / "__init__.py").write_text("")
    (root / "sandbox" / "exec_server.py").write_text("print('exec server')\n")
    return root


@pytest.fixture
def builders(tmp_path, monkeypatch):
    """A PATH holding only fake builders; returns a function that installs one under a name and its log."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "builder.log"
    monkeypatch.setenv("PATH", str(bindir))  # only the fakes, even where a real apptainer is installed
    monkeypatch.setenv("FAKE_BUILDER_LOG", str(log))

    def install(name: str = "apptainer") -> Path:
        exe = bindir / name
        exe.write_text(f"#!/bin/sh\nFAKE_BUILDER_NAME={name} exec {sys.executable} {FAKE_BUILDER} \"$@\"\n")
        exe.chmod(0o755)
        return exe

    def calls() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    install.calls = calls
    return install


def plan(project: Path, store: Path, **kw) -> ib.BuildPlan:
    kw.setdefault("base", "docker://python:3.11-slim")
    return ib.plan_build(project_root=project, store=store, **kw)


def build(p: ib.BuildPlan) -> Path:
    return ib.execute_plan(p, check_base=False, log=lambda m: None)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "singularity.build", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=60)


# ------------------------------------------------------------------------------------------ dry run / CLI


def test_dry_run_alone_prints_default_definition_cache_decision_and_exact_command(tmp_path):
    store = tmp_path / "store"
    (tmp_path / "empty-bin").mkdir()
    env = dict(os.environ, PRORL_IMAGE_STORE=str(store), PATH=str(tmp_path / "empty-bin"), PYTHONPATH=str(REPO))
    r = cli("--dry-run", env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Bootstrap: docker\nFrom: python:3.11-slim\n" in out
    assert "exec /opt/prorl/venv/bin/python -I -m sandbox.exec_server" in out
    assert "pip install --no-cache-dir ptyprocess ipykernel jupyter-client pyzmq" in out
    key = next(line.split()[-1] for line in out.splitlines() if line.startswith("# key:"))
    assert len(key) == 64
    assert f"# decision: build: no image with this key in {store}/index.json" in out
    command = f"apptainer build --force {store}/images/prorl-exec-{key[:16]}.sif {store}/defs/prorl-exec-{key[:16]}.def"
    assert command in out.splitlines()
    assert "no apptainer or singularity on PATH" in out
    assert not store.exists(), "a dry run wrote into the image store"


def test_build_without_any_builder_binary_fails_with_a_clear_message(tmp_path):
    (tmp_path / "empty-bin").mkdir()
    env = dict(os.environ, PRORL_IMAGE_STORE=str(tmp_path / "store"), PATH=str(tmp_path / "empty-bin"),
               PYTHONPATH=str(REPO))
    r = cli(env=env)
    assert r.returncode == 2
    assert "no apptainer or singularity on PATH" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "store" / "index.json").exists()


def test_list_templates_shows_the_shipped_templates_without_partials():
    assert ib.list_templates() == ["execution_server", "swe"]


# ------------------------------------------------------------------------------------------ rendering


@pytest.mark.parametrize("ref, header", [
    ("docker://python:3.11-slim", "Bootstrap: docker\nFrom: python:3.11-slim\n"),
    ("library://library/default/ubuntu:22.04", "Bootstrap: library\nFrom: library/default/ubuntu:22.04\n"),
    ("oras://ghcr.io/org/img:1", "Bootstrap: oras\nFrom: ghcr.io/org/img:1\n"),
])
def test_bootstrap_header_follows_the_kind_of_base(project, tmp_path, ref, header):
    assert plan(project, tmp_path / "s", base=ref).definition.startswith(header)


def test_existing_sif_and_localimage_url_bootstrap_from_the_local_file(project, tmp_path):
    sif = tmp_path / "base.sif"
    sif.write_bytes(b"SIF")
    for ref in (str(sif), f"localimage://{sif}"):
        d = plan(project, tmp_path / "s", base=ref).definition
        assert d.startswith(f"Bootstrap: localimage\nFrom: {sif}\n"), d[:80]


@pytest.mark.parametrize("ref, message", [
    ("python:3.11", "did you mean docker://python:3.11"),
    ("ftp://host/img", "unknown scheme"),
])
def test_base_without_a_known_scheme_is_refused(project, tmp_path, ref, message):
    with pytest.raises(ib.ImageBuildError, match=message):
        plan(project, tmp_path / "s", base=ref)


def test_missing_template_variables_are_all_named_instead_of_rendered_empty(project, tmp_path):
    with pytest.raises(ib.TemplateVariableMissing, match="repo_commit, repo_url"):
        plan(project, tmp_path / "s", template="swe")
    d = plan(project, tmp_path / "s", template="swe",
             variables={"repo_url": "https://example.org/r.git", "repo_commit": "abc123"}).definition
    assert "git clone https://example.org/r.git /testbed" in d and "checkout --detach abc123" in d
    assert "org.prorl.template swe" in d and "/opt/prorl/venv/bin/python -m pip install" in d


def test_user_template_with_a_typo_in_a_variable_name_fails(project, tmp_path):
    tdir = tmp_path / "templates"
    tdir.mkdir()
    (tdir / "mine.def.j2").write_text("Bootstrap: {{ base_bootstrap }}\nFrom: {{ base_from }}\n%post\n  {{ instal_cmd }}\n")
    with pytest.raises(ib.TemplateVariableMissing, match="instal_cmd"):
        plan(project, tmp_path / "s", template="mine", templates_dir=tdir)


def test_unknown_template_lists_the_available_ones(project, tmp_path):
    with pytest.raises(ib.ImageBuildError, match="no template 'gpu'.*execution_server, swe"):
        plan(project, tmp_path / "s", template="gpu")


def test_set_values_are_parsed_as_json_lists(project, tmp_path):
    variables = ib.parse_set(['python_packages=["numpy==2.1.0", "sympy"]', "exec_server_module=my.server"])
    d = plan(project, tmp_path / "s", variables=variables).definition
    assert "ptyprocess ipykernel jupyter-client pyzmq numpy==2.1.0 sympy\n" in d
    assert "-m my.server" in d
    with pytest.raises(ib.ImageBuildError, match="NAME=VALUE"):
        ib.parse_set(["novalue"])


# ------------------------------------------------------------------------------------------ Dockerfile


def test_dockerfile_converts_without_singularity_and_gains_the_execution_server(project, tmp_path):
    ctx = tmp_path / "ctx"
    (ctx / "app").mkdir(parents=True)
    (ctx / "Dockerfile").write_text(
        "FROM ubuntu:22.04\nENV FOO=bar\nRUN apt-get update && apt-get install -y git\nCOPY app /opt/app\n"
        "WORKDIR /opt/app\n")
    p = plan(project, tmp_path / "s", base=None, dockerfile=ctx / "Dockerfile")
    d = p.definition
    assert p.base.ref == "docker://ubuntu:22.04" and d.startswith("Bootstrap: docker\nFrom: ubuntu:22.04\n")
    assert d.count("apt-get install -y git") == 1, "the Dockerfile was parsed twice (spython parses on construction)"
    assert "app /opt/app\n" in d and f"{p.stage_to} /opt/prorl/src\n" in d
    assert "export PRORL_EXEC_PYTHON=/opt/prorl/venv/bin/python\n" in d and "export export" not in d
    assert "/opt/prorl/venv/bin/python -m pip install --no-cache-dir /opt/prorl/src" in d
    assert p.cwd == ctx, "COPY sources are relative to the Dockerfile: the build must run there"
    plain = plan(project, tmp_path / "s", base=None, dockerfile=ctx / "Dockerfile", exec_server=False).definition
    assert "/opt/prorl" not in plain


def test_dockerfile_with_a_base_option_is_refused(project, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM alpine:3\n")
    with pytest.raises(ib.ImageBuildError, match="FROM line is the base"):
        ib.plan_build(dockerfile=tmp_path / "Dockerfile", base="docker://x", project_root=project, store=tmp_path)


# ------------------------------------------------------------------------------------------ keys


def test_versioned_key_ignores_source_edits_but_not_a_version_bump_or_another_base(project, tmp_path):
    k0 = plan(project, tmp_path / "s").key
    (project / "sandbox" / "exec_server.py").write_text("print('edited')\n")
    assert plan(project, tmp_path / "s").key == k0
    assert plan(project, tmp_path / "s", base="docker://python:3.12-slim").key != k0
    (project / "setup.cfg").write_text("[metadata]\nname = prorl-server\nversion = 1.2.4\n")
    assert plan(project, tmp_path / "s").key != k0


def test_lock_key_changes_with_the_lock_file_only(project, tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("numpy==2.1.0\n")
    k0 = plan(project, tmp_path / "s", mode="lock", lock_files=[lock]).key
    (project / "setup.cfg").write_text("[metadata]\nname = prorl-server\nversion = 9.9.9\n")
    assert plan(project, tmp_path / "s", mode="lock", lock_files=[lock]).key == k0
    lock.write_text("numpy==2.1.1\n")
    assert plan(project, tmp_path / "s", mode="lock", lock_files=[lock]).key != k0
    with pytest.raises(ib.ImageBuildError, match="lock file .*nope"):
        plan(project, tmp_path / "s", mode="lock", lock_files=[tmp_path / "nope"])


def test_scratch_key_covers_the_project_source(project, tmp_path):
    k0 = plan(project, tmp_path / "s", mode="scratch").key
    (project / "sandbox" / "exec_server.py").write_text("print('edited')\n")
    assert plan(project, tmp_path / "s", mode="scratch").key != k0


def test_modes_never_share_a_key(project, tmp_path):
    keys = {m: plan(project, tmp_path / "s", mode=m).key for m in ib.CACHE_MODES}
    assert len(set(keys.values())) == 3


def test_tree_hash_ignores_bytecode_and_mtimes(project):
    h0 = ib.tree_hash(project, ib.PROJECT_PACKAGES)
    (project / "sandbox" / "__pycache__").mkdir()
    (project / "sandbox" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    os.utime(project / "sandbox" / "exec_server.py", (1, 1))
    assert ib.tree_hash(project, ib.PROJECT_PACKAGES) == h0
    (project / "sandbox" / "new.py").write_text("")
    assert ib.tree_hash(project, ib.PROJECT_PACKAGES) != h0


# ------------------------------------------------------------------------------------------ build + cache


def test_versioned_image_is_built_once_then_reused_without_calling_the_builder(project, tmp_path, builders):
    builders("apptainer")
    store = tmp_path / "store"
    p1 = plan(project, store)
    assert p1.decision == "build"
    image = build(p1)
    assert image == store / "images" / f"prorl-exec-{p1.key[:16]}.sif" and image.is_file()
    assert json.loads(Path(f"{image}.key.json").read_text())["key"] == p1.key
    index = json.loads((store / "index.json").read_text())["images"]
    assert [(e["name"], e["mode"], e["key"], e["path"]) for e in index] == [("prorl-exec", "versioned", p1.key, str(image))]
    staged = store / "build" / "prorl-exec" / "prorl-src"
    assert (staged / "sandbox" / "exec_server.py").exists() and (staged / "setup.cfg").exists()
    [call] = builders.calls()
    assert call["argv"] == ["apptainer", "build", "--force", str(image), str(p1.def_path)]
    p2 = plan(project, store)
    assert (p2.decision, p2.image_path) == ("reuse", image)
    assert build(p2) == image and len(builders.calls()) == 1


def test_scratch_rebuilds_every_time(project, tmp_path, builders):
    builders("apptainer")
    for _ in range(2):
        p = plan(project, tmp_path / "store", mode="scratch")
        assert p.decision == "build" and "always rebuilds" in p.reason
        build(p)
    assert len(builders.calls()) == 2


def test_image_replaced_or_deleted_outside_the_store_is_rebuilt(project, tmp_path, builders):
    builders("apptainer")
    image = build(plan(project, tmp_path / "store"))
    Path(f"{image}.key.json").write_text(json.dumps({"key": "0" * 64}))
    p = plan(project, tmp_path / "store")
    assert p.decision == "build" and "does not hold this key" in p.reason
    build(p)
    image.unlink()
    p = plan(project, tmp_path / "store")
    assert p.decision == "build" and "file is gone" in p.reason


def test_fakeroot_and_the_singularity_fallback_are_in_the_exact_command(project, tmp_path, builders):
    exe = builders("singularity")
    p = plan(project, tmp_path / "store", fakeroot=True, extra_build_args=["--notest"])
    assert p.command == [str(exe), "build", "--fakeroot", "--force", "--notest", str(p.image_path), str(p.def_path)]
    build(p)
    assert builders.calls()[0]["argv"][:3] == ["singularity", "build", "--fakeroot"]


def test_apptainer_is_preferred_when_both_builders_exist(project, tmp_path, builders):
    builders("singularity")
    exe = builders("apptainer")
    assert plan(project, tmp_path / "store").command[0] == str(exe)


def test_failed_build_leaves_no_index_entry_and_no_key_file(project, tmp_path, builders, monkeypatch):
    builders("apptainer")
    monkeypatch.setenv("FAKE_BUILDER_FAIL", "FATAL: While performing build: conveyor failed: boom")
    p = plan(project, tmp_path / "store")
    with pytest.raises(ib.BuildFailed, match="(?s)exit 255.*boom"):
        build(p)
    assert not (tmp_path / "store" / "index.json").exists()
    assert not Path(f"{p.image_path}.key.json").exists()
    assert plan(project, tmp_path / "store").decision == "build"


def test_builder_that_cannot_fetch_the_base_reports_an_unreachable_base(project, tmp_path, builders, monkeypatch):
    builders("apptainer")
    monkeypatch.setenv("FAKE_BUILDER_FAIL", 'FATAL: Unable to get image: failed to get checksum for '
                       'docker://python:3.99: reading manifest 3.99 in docker.io/library/python: manifest unknown')
    with pytest.raises(ib.BaseImageUnreachable, match="docker://python:3.11-slim could not be fetched"):
        build(plan(project, tmp_path / "store"))


def test_dockerfile_build_runs_in_the_dockerfile_directory(project, tmp_path, builders):
    builders("apptainer")
    ctx = tmp_path / "ctx"
    (ctx / "app").mkdir(parents=True)
    (ctx / "Dockerfile").write_text("FROM alpine:3.20\nCOPY app /opt/app\n")
    image = build(ib.plan_build(dockerfile=ctx / "Dockerfile", project_root=project, store=tmp_path / "store"))
    assert image.is_file() and builders.calls()[0]["cwd"] == str(ctx)


def test_concurrent_builds_recording_into_one_index_lose_no_entry(tmp_path):
    store = ib.ImageStore(tmp_path / "store")

    def record(i: int) -> None:
        store.record({"name": f"img{i}", "mode": "versioned", "key": f"{i:064d}", "path": f"/x/{i}.sif"})

    threads = [threading.Thread(target=record, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(e["name"] for e in store.entries()) == sorted(f"img{i}" for i in range(24))


def test_cli_build_with_fake_builder_prints_the_image_path(project, tmp_path, builders):
    builders("apptainer")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = ("--project-root", str(project), "--store", str(tmp_path / "store"), "--no-check-base")
    r = cli(*args, env=env)
    assert r.returncode == 0, r.stderr
    image = Path(r.stdout.strip())
    assert image.is_file() and image.parent == tmp_path / "store" / "images"
    r2 = cli(*args, "--dry-run", env=env)
    assert f"# decision: reuse: image with this key in {tmp_path}/store/index.json" in r2.stdout


# ------------------------------------------------------------------------------------------ base reachability


class FakeRegistry:
    """Stands for a Docker registry (HTTP API v2 with anonymous bearer tokens, as Docker Hub): serves
    ``lib/img:1.0`` only, and only with the token from its /token endpoint."""

    def __init__(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _manifest(self, head: bool):
                if self.headers.get("Authorization") != "Bearer tok-123":
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", f'Bearer realm="{outer.url}/token",service="fake",'
                                                         f'scope="repository:lib/img:pull"')
                    self.end_headers()
                    return
                self.send_response(200 if self.path == "/v2/lib/img/manifests/1.0" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_HEAD(self):  # noqa: N802
                self._manifest(True)

            def do_GET(self):  # noqa: N802
                if self.path.startswith("/token?"):
                    body = json.dumps({"token": "tok-123"}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    self._manifest(False)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        self.url = f"http://{self.host}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def registry():
    r = FakeRegistry()
    yield r
    r.close()


def test_reachable_docker_base_passes_the_check_through_a_bearer_token(registry):
    note = ib.check_base_reachable(ib.parse_base(f"docker://{registry.host}/lib/img:1.0"), timeout_s=5)
    assert "found" in note


def test_docker_base_with_an_unknown_tag_is_unreachable(registry):
    with pytest.raises(ib.BaseImageUnreachable, match="has no such image or tag.*--no-check-base"):
        ib.check_base_reachable(ib.parse_base(f"docker://{registry.host}/lib/img:2.0"), timeout_s=5)


def test_docker_base_on_a_registry_that_does_not_answer_is_unreachable():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ib.BaseImageUnreachable, match=f"127.0.0.1:{port}.*(refused|unreachable)"):
        ib.check_base_reachable(ib.parse_base(f"docker://127.0.0.1:{port}/lib/img:1.0"), timeout_s=5)


def test_missing_local_base_fails_even_in_a_dry_run(tmp_path):
    env = dict(os.environ, PRORL_IMAGE_STORE=str(tmp_path / "store"), PYTHONPATH=str(REPO))
    r = cli("--dry-run", "--base", str(tmp_path / "missing.sif"), env=env)
    assert r.returncode == 2 and "missing.sif does not exist" in r.stderr


def test_docker_reference_parsing_matches_docker_defaults():
    assert ib._docker_ref_parts("python:3.11-slim") == ("registry-1.docker.io", "library/python", "3.11-slim")
    assert ib._docker_ref_parts("org/img") == ("registry-1.docker.io", "org/img", "latest")
    assert ib._docker_ref_parts("ghcr.io/org/img:1") == ("ghcr.io", "org/img", "1")
    assert ib._docker_ref_parts("localhost:5000/img@sha256:ab") == ("localhost:5000", "img", "sha256:ab")
    assert ib._docker_ref_parts("docker.io/library/python:3") == ("registry-1.docker.io", "library/python", "3")


# ------------------------------------------------------------------------------------------ real build


@pytest.mark.real
def test_real_build_of_the_default_image(tmp_path):
    builder = shutil.which("apptainer") or shutil.which("singularity")
    if builder is None:
        reason = "no apptainer or singularity binary on this machine: the real image build is not tested here"
        print(reason, file=sys.stderr)
        pytest.skip(reason)
    p = ib.plan_build(store=tmp_path / "store", fakeroot=os.geteuid() != 0)
    image = ib.execute_plan(p, check_base=True, timeout_s=1800)
    r = subprocess.run([builder, "exec", str(image), "/opt/prorl/venv/bin/python", "-c",
                        "import ptyprocess, ipykernel, jupyter_client, sandbox.exec_server"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert ib.plan_build(store=tmp_path / "store").decision == "reuse"


# ------------------------------------------------------------------------------------------ templates shipped


def test_the_default_templates_are_the_ones_beside_the_builder():
    assert ib.DEFAULT_TEMPLATES_DIR == REPO / "singularity" / "templates"
    assert ib.list_templates() == ["execution_server", "swe"]


@pytest.mark.real
def test_installed_wheel_ships_the_templates_and_the_builder_finds_them(tmp_path):
    """An installed project (not a checkout) carries the templates as package data of ``singularity`` and
    ``prorl-build-image`` finds them there."""
    templates = sorted(p.name for p in (REPO / "singularity" / "templates").iterdir() if p.name != "__pycache__")
    src = tmp_path / "src"
    src.mkdir()
    # A clean copy of what a clone holds (no build/ or egg-info in the shared checkout).
    for name in ("setup.cfg", "pyproject.toml", "README.md", "MANIFEST.in", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    for name in ("prorl_server", "sandbox", "handlers", "trainer_plugins", "singularity"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(src)], check=True, capture_output=True)
    (wheel,) = wheels.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n.split("/", 2)[2] for n in names if n.startswith("singularity/templates/")) == templates, names
    assert "singularity/build.py" in names and not any(".data/" in n for n in names), names
    chat_templates = sorted(p.name for p in (REPO / "prorl_server" / "llm" / "chat_templates" / "templates").glob("*.jinja"))
    assert chat_templates and sorted(n.rsplit("/", 1)[1] for n in names
                                     if n.startswith("prorl_server/llm/chat_templates/templates/")) == chat_templates

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)
    # The installed project first; its dependencies (jinja2, ...) from this environment after it.
    installed_site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    check=True, capture_output=True, text=True).stdout.strip()
    env = {**os.environ, "PYTHONPATH": f"{installed_site}:{sysconfig.get_paths()['purelib']}"}
    env.pop("PRORL_TEMPLATES_DIR", None)
    out = subprocess.run([str(py), "-c", "from singularity.build import DEFAULT_TEMPLATES_DIR as d, list_templates"
                          " as l; print(d); print(*l())"], check=True, capture_output=True, text=True, env=env,
                         cwd=str(tmp_path)).stdout.split("\n")
    assert out[0] == os.path.join(installed_site, "singularity", "templates")
    assert out[1].split() == sorted(t[:-len(".def.j2")] for t in templates
                                    if t.endswith(".def.j2") and not t.startswith("_"))
