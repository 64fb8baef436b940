"""``prorl-build-image``: Singularity/Apptainer images (``.sif``) for the sandboxes, with a content-hash cache.

A definition file comes from a Jinja2 template in ``singularity/templates/`` (package data of this package,
so the same directory in a checkout and an installed wheel: :data:`DEFAULT_TEMPLATES_DIR`), rendered with
StrictUndefined (a missing variable is an error naming it, never an empty string), or from a user's
Dockerfile, converted by spython's recipe parser and writer (no Singularity binary needed), with the
execution-server layer added.
It is built with ``apptainer build`` or ``singularity build`` (whichever is on PATH), ``--fakeroot`` on request.

Cache modes, after ProRL Agent / OpenHands' runtime builder; the key of each is a sha256 written next to the
image (``<image>.key.json``) and recorded in the image store's ``index.json``:

- ``scratch``   always rebuild. Key = definition + project version + project source + lock files (a record).
- ``versioned`` reuse the stored image when the definition (base image, template, variables) and the project
  version are unchanged. Source edits without a version bump are NOT noticed: use scratch while developing.
- ``lock``      reuse when the definition and the dependency lock files (``--lock``, default: the project's
  ``setup.cfg`` and ``pyproject.toml``) are unchanged.

The store (``--store``, ``$PRORL_IMAGE_STORE``, default ``~/.cache/prorl/images``) holds ``images/*.sif`` with
their key files, ``defs/*.def`` (what was built), ``build/<name>/`` (the staged project source) and
``index.json``, updated under an ``flock`` so concurrent builds on a shared filesystem do not lose entries.

``prorl-build-image --dry-run`` prints the rendered definition, the cache decision and the exact build
command, and builds nothing. Errors exit with status 2 and one clear message: no builder binary, a template
variable missing, a base image that is unreachable (a missing local file; for ``docker://``, a registry
that does not answer or does not have the tag, checked before a real build unless ``--no-check-base``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import jinja2
import jinja2.meta

#: The project root of a checkout (the parent of this package): ``--project-root``'s default, staged into images.
REPO_ROOT = Path(__file__).resolve().parent.parent
#: The shipped templates: ``templates/`` next to this module (setup.cfg ``package_data``), checkout or installed.
DEFAULT_TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
DEFAULT_TEMPLATE = "execution_server"
DEFAULT_BASE = "docker://python:3.11-slim"
CACHE_MODES = ("scratch", "versioned", "lock")
BUILDERS = ("apptainer", "singularity")
KEY_SUFFIX = ".key.json"
#: What of the project goes into an image (and into the scratch key): installable with ``pip install DIR``.
PROJECT_FILES = ("pyproject.toml", "setup.cfg", "setup.py", "README.md", "LICENSE")
PROJECT_PACKAGES = ("prorl_server", "sandbox", "handlers", "trainer_plugins", "singularity")
DEFAULT_LOCK_FILES = ("setup.cfg", "pyproject.toml")
#: Builder stderr that means the base image could not be fetched (Apptainer 1.x / SingularityCE 3.x / 4.x).
UNREACHABLE_PATTERNS = re.compile(
    r"failed to get checksum|unable to retrieve|manifest unknown|no such host|connection refused|"
    r"i/o timeout|name unknown|unauthorized|could not resolve|not found in registry|no such file or directory.*sif",
    re.IGNORECASE)


class ImageBuildError(Exception):
    """A user-facing error: the message says what is wrong and what to do. Exit status 2."""


class BuilderNotFound(ImageBuildError):
    pass


class TemplateVariableMissing(ImageBuildError):
    pass


class BaseImageUnreachable(ImageBuildError):
    pass


class BuildFailed(ImageBuildError):
    pass


# ------------------------------------------------------------------------------------------ base images


@dataclasses.dataclass(frozen=True)
class BaseImage:
    """A base reference split into the definition header: ``Bootstrap: {bootstrap}`` / ``From: {source}``.

    ``ref`` is what the user wrote: ``docker://python:3.11-slim``, ``library://...``, ``oras://...``,
    ``localimage://PATH`` or a plain path to an existing ``.sif`` file or sandbox directory.
    """

    ref: str
    bootstrap: str
    source: str

    @property
    def is_local(self) -> bool:
        return self.bootstrap == "localimage"


def parse_base(ref: str) -> BaseImage:
    """Parse a base reference. Raises :class:`ImageBuildError` for an unknown scheme."""
    for scheme in ("docker", "library", "oras", "docker-daemon", "docker-archive"):
        if ref.startswith(f"{scheme}://"):
            return BaseImage(ref, scheme, ref[len(scheme) + 3:])
    if ref.startswith("localimage://"):
        return BaseImage(ref, "localimage", str(Path(ref[len("localimage://"):]).expanduser().resolve()))
    if "://" in ref:
        raise ImageBuildError(f"base image {ref!r}: unknown scheme; use docker://, library://, oras://, "
                              "localimage://PATH or a path to a .sif")
    if ref.endswith(".sif") or "/" in ref or Path(ref).exists():
        return BaseImage(ref, "localimage", str(Path(ref).expanduser().resolve()))
    raise ImageBuildError(f"base image {ref!r}: not a path and no scheme; did you mean docker://{ref} ?")


def _docker_ref_parts(source: str) -> tuple[str, str, str]:
    """``python:3.11-slim`` -> (``registry-1.docker.io``, ``library/python``, ``3.11-slim``), as docker does."""
    name, _, digest = source.partition("@")
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
        if registry in ("docker.io", "index.docker.io"):
            registry = "registry-1.docker.io"
    else:
        registry, path = "registry-1.docker.io", name
    if registry == "registry-1.docker.io" and "/" not in path.split(":")[0]:
        path = "library/" + path
    repo, _, tag = path.rpartition(":") if ":" in path.rsplit("/", 1)[-1] else (path, "", "latest")
    return registry, repo, digest or tag


def check_base_reachable(base: BaseImage, timeout_s: float = 10.0) -> str:
    """Check that the base exists before a build; return a one-line note of what was checked.

    Local bases: the file or sandbox directory must exist. ``docker://``: the registry must answer and have
    the tag (Docker Registry HTTP API v2: ``GET /v2/``, an anonymous bearer token when asked for one, then
    ``HEAD /v2/<repo>/manifests/<tag>``); https, or http for a registry on localhost/127.x like docker's
    own insecure default. Other schemes are not checked. Raises :class:`BaseImageUnreachable`.
    """
    if base.is_local:
        p = Path(base.source)
        if not (p.is_file() or p.is_dir()):
            raise BaseImageUnreachable(f"base image {base.ref}: {p} does not exist (build it first, or fix the path)")
        return f"local base {p} exists"
    if base.bootstrap != "docker":
        return f"{base.bootstrap}:// base not checked"
    registry, repo, ref = _docker_ref_parts(base.source)
    host = registry.split(":")[0]
    scheme = "http" if host in ("localhost", "127.0.0.1") or host.startswith("127.") else "https"
    root = f"{scheme}://{registry}"
    accept = ", ".join((
        "application/vnd.oci.image.index.v1+json", "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.docker.distribution.manifest.v2+json"))
    hint = "check the name and the network, or pass --no-check-base to let the builder try anyway"

    def request(url: str, headers: dict[str, str], method: str = "GET"):
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers, method=method),
                                      timeout=timeout_s)

    headers = {"Accept": accept}
    manifest = f"{root}/v2/{repo}/manifests/{ref}"
    try:
        try:
            request(manifest, headers, "HEAD").close()
            return f"{base.ref} found in {registry}"
        except urllib.error.HTTPError as e:
            if e.code != 401 or "bearer" not in e.headers.get("WWW-Authenticate", "").lower():
                raise
            challenge = dict(re.findall(r'(\w+)="([^"]*)"', e.headers["WWW-Authenticate"]))
        query = {"service": challenge.get("service", ""), "scope": challenge.get("scope", f"repository:{repo}:pull")}
        with request(challenge["realm"] + "?" + urllib.parse.urlencode(query), {}) as r:
            token_doc = json.loads(r.read())
        headers["Authorization"] = "Bearer " + (token_doc.get("token") or token_doc.get("access_token", ""))
        request(manifest, headers, "HEAD").close()
        return f"{base.ref} found in {registry}"
    except urllib.error.HTTPError as e:
        what = {404: "has no such image or tag", 401: "refused anonymous access", 403: "refused access"}
        raise BaseImageUnreachable(f"base image {base.ref} is unreachable: {registry} "
                                   f"{what.get(e.code, f'answered HTTP {e.code}')} ({hint})") from None
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        reason = getattr(e, "reason", e)
        raise BaseImageUnreachable(f"base image {base.ref} is unreachable: {registry}: {reason} ({hint})") from None


# ------------------------------------------------------------------------------------------ definitions


def _environment(templates_dir: Path) -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                              autoescape=False)


def list_templates(templates_dir: Path = DEFAULT_TEMPLATES_DIR) -> list[str]:
    """Template names (``<name>.def.j2`` files not starting with ``_``)."""
    return sorted(p.name[:-len(".def.j2")] for p in Path(templates_dir).glob("*.def.j2") if not p.name.startswith("_"))


def template_defaults(name: str, templates_dir: Path = DEFAULT_TEMPLATES_DIR) -> dict[str, Any]:
    """``_defaults.vars.json`` updated by ``<name>.vars.json`` (both optional)."""
    out: dict[str, Any] = {}
    for f in ("_defaults.vars.json", f"{name}.vars.json"):
        p = Path(templates_dir) / f
        if p.exists():
            try:
                out.update(json.loads(p.read_text()))
            except json.JSONDecodeError as e:
                raise ImageBuildError(f"{p}: not JSON ({e})") from None
    return out


def _undeclared(env: jinja2.Environment, name: str, seen: Optional[set] = None) -> set[str]:
    """Variables a template and the templates it extends/includes reference but do not set."""
    seen = set() if seen is None else seen
    if name in seen:
        return set()
    seen.add(name)
    source = env.loader.get_source(env, name)[0]
    ast = env.parse(source)
    names = set(jinja2.meta.find_undeclared_variables(ast))
    for ref in jinja2.meta.find_referenced_templates(ast):
        if ref:
            names |= _undeclared(env, ref, seen)
    return names


def render_template(name: str, variables: dict[str, Any], templates_dir: Path = DEFAULT_TEMPLATES_DIR) -> str:
    """Render ``<templates_dir>/<name>.def.j2`` with ``variables`` (StrictUndefined).

    Raises :class:`ImageBuildError` for an unknown template and :class:`TemplateVariableMissing` listing every
    variable the template needs and did not get.
    """
    env = _environment(Path(templates_dir))
    fname = f"{name}.def.j2"
    try:
        template = env.get_template(fname)
    except jinja2.TemplateNotFound:
        raise ImageBuildError(f"no template {name!r} in {templates_dir} (have: "
                              f"{', '.join(list_templates(templates_dir)) or 'none'})") from None
    except jinja2.TemplateSyntaxError as e:
        raise ImageBuildError(f"template {e.filename or fname} line {e.lineno}: {e.message}") from None
    missing = sorted(_undeclared(env, fname) - set(variables) - set(env.globals))
    if missing:
        raise TemplateVariableMissing(
            f"template {name!r} needs variable(s) {', '.join(missing)}: pass --set NAME=VALUE or --vars FILE")
    try:
        return template.render(**variables)
    except jinja2.UndefinedError as e:  # e.g. an attribute of a variable that is missing
        raise TemplateVariableMissing(f"template {name!r}: {e.message}: pass --set NAME=VALUE") from None


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def dockerfile_to_definition(dockerfile: Path, exec_server_post: Optional[str] = None,
                             extra_files: Sequence[tuple[str, str]] = (),
                             extra_env: Sequence[str] = ()) -> tuple[str, BaseImage]:
    """Convert a Dockerfile into a definition with spython (``DockerParser`` -> ``SingularityWriter``).

    ``exec_server_post`` (shell text), ``extra_files`` ((host, image) pairs) and ``extra_env`` (``NAME=value``
    lines; the writer adds ``export``) are appended to the recipe before writing, which is how the execution-server layer is added.
    Returns the definition and the base parsed from ``FROM``. Relative ``COPY`` sources stay relative: the
    build runs in the Dockerfile's directory. Raises :class:`ImageBuildError` when the file cannot be parsed.
    """
    from spython.main.parse.parsers import DockerParser
    from spython.main.parse.writers import SingularityWriter

    dockerfile = Path(dockerfile).resolve()
    if not dockerfile.is_file():
        raise ImageBuildError(f"no Dockerfile at {dockerfile}")
    try:
        with _cwd(dockerfile.parent):  # spython checks COPY sources relative to the working directory
            parser = DockerParser(str(dockerfile))  # parses on construction; .parse() again would duplicate
        recipes = parser.recipe
        last = list(recipes.values())[-1]
        for src, dst in extra_files:
            last.files.append([src, dst])
        if exec_server_post:
            last.install.extend(exec_server_post.splitlines())
        last.environ.extend(extra_env)
        definition = SingularityWriter(recipes).convert()
    except Exception as e:  # spython raises bare exceptions / SystemExit-free errors on odd input
        raise ImageBuildError(f"{dockerfile}: cannot convert to a definition file: {e}") from None
    m = re.search(r"^Bootstrap:\s*(\S+)\s*$\n^From:\s*(\S+)\s*$", definition, re.MULTILINE)
    if not m:
        raise ImageBuildError(f"{dockerfile}: no FROM line")
    bootstrap, source = m.groups()
    ref = f"{bootstrap}://{source}" if bootstrap != "localimage" else source
    return (definition if definition.endswith("\n") else definition + "\n"), BaseImage(ref, bootstrap, source)


# ------------------------------------------------------------------------------------------ hashing


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_hash(root: Path, entries: Sequence[str]) -> str:
    """sha256 over (relative path, content sha256) of every file under ``root/<entry>``, sorted; ``__pycache__``
    and ``*.pyc`` skipped. Entries that do not exist are skipped. Independent of mtimes and walk order."""
    h = hashlib.sha256()
    root = Path(root)
    files: list[Path] = []
    for e in entries:
        p = root / e
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files.extend(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts
                         and f.suffix != ".pyc")
    for f in sorted(files, key=lambda f: f.relative_to(root).as_posix()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + _sha256_bytes(f.read_bytes()).encode() + b"\n")
    return h.hexdigest()


def files_digest(paths: Sequence[Path]) -> dict[str, str]:
    """``{path: sha256 of content}``; a missing file raises :class:`ImageBuildError`."""
    out = {}
    for p in paths:
        try:
            out[str(p)] = _sha256_bytes(Path(p).read_bytes())
        except OSError as e:
            raise ImageBuildError(f"lock file {p}: {e.strerror}") from None
    return out


def base_identity(base: BaseImage) -> str:
    """What identifies the base for the cache: the reference, plus size and mtime for a local file (hashing a
    multi-GB .sif on every run would cost more than it saves). Pin remote bases by digest to be exact."""
    if base.is_local:
        try:
            st = Path(base.source).stat()
            return f"{base.ref} size={st.st_size} mtime_ns={st.st_mtime_ns}"
        except OSError:
            return f"{base.ref} (missing)"
    return base.ref


def cache_key(mode: str, definition: str, base_id: str, project_version: str, source_hash: str,
              lock_digest: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """The cache key of ``mode`` (hex sha256) and the inputs it covers (what the key file records)."""
    if mode not in CACHE_MODES:
        raise ImageBuildError(f"unknown cache mode {mode!r}; choose one of {', '.join(CACHE_MODES)}")
    inputs: dict[str, Any] = {"mode": mode, "definition_sha256": _sha256_bytes(definition.encode()),
                              "base": base_id}
    if mode in ("versioned", "scratch"):
        inputs["project_version"] = project_version
    if mode in ("lock", "scratch"):
        inputs["lock"] = {Path(k).name: v for k, v in sorted(lock_digest.items())}
    if mode == "scratch":
        inputs["source_sha256"] = source_hash
    return _sha256_bytes(json.dumps(inputs, sort_keys=True).encode()), inputs


def project_version(project_root: Path = REPO_ROOT) -> str:
    """``version`` from the project's setup.cfg, else the installed distribution's, else ``"unknown"``."""
    cfg = Path(project_root) / "setup.cfg"
    if cfg.exists():
        m = re.search(r"^version\s*=\s*(\S+)", cfg.read_text(), re.MULTILINE)
        if m:
            return m.group(1)
    try:
        from importlib.metadata import version
        return version("prorl-server")
    except Exception:
        return "unknown"


# ------------------------------------------------------------------------------------------ image store


class ImageStore:
    """A directory of built images with an ``index.json``: ``{"version": 1, "images": [entry, ...]}``, each
    entry ``{name, mode, key, path, base, created, definition}``. Updated under ``flock(index.lock)``."""

    def __init__(self, root: Path):
        self.root = Path(root).expanduser().resolve()

    @property
    def index_path(self) -> Path:
        return self.root / "index.json"

    def image_path(self, name: str, key: str) -> Path:
        return self.root / "images" / f"{name}-{key[:16]}.sif"

    def def_path(self, name: str, key: str) -> Path:
        return self.root / "defs" / f"{name}-{key[:16]}.def"

    def staging_dir(self, name: str) -> Path:
        return self.root / "build" / name

    def entries(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.index_path.read_text())
        except FileNotFoundError:
            return []
        except json.JSONDecodeError:
            return []  # a damaged index only costs rebuilds; it is rewritten on the next record()
        return [e for e in data.get("images", []) if isinstance(e, dict)]

    def lookup(self, name: str, mode: str, key: str) -> tuple[Optional[Path], str]:
        """The stored image for (name, mode, key), or None, with the reason of the decision."""
        for e in self.entries():
            if (e.get("name"), e.get("mode"), e.get("key")) != (name, mode, key):
                continue
            path = Path(e.get("path", ""))
            if not path.is_file():
                return None, f"index lists {path} but the file is gone"
            try:
                recorded = json.loads(Path(str(path) + KEY_SUFFIX).read_text()).get("key")
            except (OSError, json.JSONDecodeError):
                recorded = None
            if recorded != key:
                return None, f"{path}{KEY_SUFFIX} does not hold this key (image replaced outside the store?)"
            return path, f"image with this key in {self.index_path}"
        return None, f"no image with this key in {self.index_path}"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "index.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def record(self, entry: dict[str, Any]) -> None:
        """Add or replace the entry for (name, mode, key); written atomically."""
        with self._locked():
            entries = [e for e in self.entries()
                       if (e.get("name"), e.get("mode"), e.get("key")) != (entry["name"], entry["mode"], entry["key"])]
            entries.append(entry)
            tmp = self.index_path.with_suffix(f".json.tmp.{os.getpid()}")
            tmp.write_text(json.dumps({"version": 1, "images": entries}, indent=2) + "\n")
            os.replace(tmp, self.index_path)


def default_store() -> Path:
    if os.environ.get("PRORL_IMAGE_STORE"):
        return Path(os.environ["PRORL_IMAGE_STORE"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "prorl" / "images"


# ------------------------------------------------------------------------------------------ builder


def find_builder(preferred: Optional[str] = None) -> str:
    """Path of the builder: ``preferred`` (a name or path) or ``apptainer``, then ``singularity``, on PATH.

    Raises :class:`BuilderNotFound` when none is there.
    """
    candidates = (preferred,) if preferred else BUILDERS
    for c in candidates:
        found = shutil.which(c)
        if found:
            return found
    raise BuilderNotFound(f"no {' or '.join(candidates)} on PATH: install Apptainer (https://apptainer.org) "
                          "or load its module (module load apptainer), or use --dry-run to see the plan")


def build_command(builder: str, image: Path, definition_file: Path, fakeroot: bool = False,
                  extra_args: Sequence[str] = ()) -> list[str]:
    """``<builder> build [--fakeroot] --force [extra] IMAGE DEFINITION`` (--force: a stale unindexed file at
    IMAGE is from a failed or foreign build and is replaced)."""
    cmd = [builder, "build"]
    if fakeroot:
        cmd.append("--fakeroot")
    cmd.append("--force")
    cmd.extend(extra_args)
    cmd.extend([str(image), str(definition_file)])
    return cmd


def stage_project(project_root: Path, dest: Path) -> None:
    """Copy the installable part of the project (PROJECT_FILES, PROJECT_PACKAGES) into ``dest`` (replaced)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in PROJECT_FILES:
        if (project_root / f).is_file():
            shutil.copy2(project_root / f, dest / f)
    for pkg in PROJECT_PACKAGES:
        if (project_root / pkg).is_dir():
            shutil.copytree(project_root / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


# ------------------------------------------------------------------------------------------ plan


@dataclasses.dataclass
class BuildPlan:
    """Everything a build would do; ``execute_plan`` does it, ``describe`` prints it."""

    name: str
    source: str                      # "template <name> (<file>)" or "Dockerfile <path>"
    base: BaseImage
    definition: str
    mode: str
    key: str
    key_inputs: dict[str, Any]
    store: ImageStore
    image_path: Path
    def_path: Path
    cwd: Path                        # where the builder runs (Dockerfile context)
    command: list[str]
    decision: str                    # "build" or "reuse"
    reason: str
    builder_found: bool
    stage_from: Optional[Path] = None    # project root to stage into stage_to
    stage_to: Optional[Path] = None
    base_check: str = "not checked (dry run; --check-base to check)"

    def describe(self) -> str:
        lines = [
            "# prorl-build-image plan (dry run: nothing is built)",
            f"# image:  {self.name} from {self.source}",
            f"# base:   {self.base.ref} (Bootstrap: {self.base.bootstrap}, From: {self.base.source}); {self.base_check}",
            f"# ---- definition (to be written to {self.def_path})",
            self.definition.rstrip("\n"),
            "# ---- cache",
            f"# mode:     {self.mode}",
            f"# key:      {self.key}",
            f"# inputs:   {json.dumps(self.key_inputs, sort_keys=True)}",
            f"# decision: {self.decision}: {self.reason}",
            f"# ---- command (in {self.cwd})",
        ]
        if self.stage_from and self.decision == "build":
            lines.append(f"# (first the project source {self.stage_from} is staged into {self.stage_to})")
        lines.append(shlex.join(self.command) if self.decision == "build" else f"# none: reuse {self.image_path}")
        if not self.builder_found:
            lines.append(f"# note: no {' or '.join(BUILDERS)} on PATH; a real build would stop with an error")
        return "\n".join(lines) + "\n"


def parse_set(values: Sequence[str]) -> dict[str, Any]:
    """``["k=v", 'pkgs=["a","b"]']`` -> ``{"k": "v", "pkgs": ["a", "b"]}`` (JSON values where they parse)."""
    out: dict[str, Any] = {}
    for item in values:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise ImageBuildError(f"--set {item!r}: expected NAME=VALUE")
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


def plan_build(*, template: Optional[str] = None, dockerfile: Optional[Path] = None, base: Optional[str] = None,
               name: Optional[str] = None, variables: Optional[dict[str, Any]] = None, mode: str = "versioned",
               lock_files: Sequence[Path] = (), store: Optional[Path] = None, output: Optional[Path] = None,
               builder: Optional[str] = None, fakeroot: bool = False, extra_build_args: Sequence[str] = (),
               templates_dir: Path = DEFAULT_TEMPLATES_DIR, project_root: Path = REPO_ROOT,
               exec_server: bool = True) -> BuildPlan:
    """Render the definition, compute the cache key and decide. Runs no builder and touches no file.

    Raises :class:`ImageBuildError` (and subclasses) for bad input: both or neither of a template given with
    a Dockerfile and --base, a missing template variable, an unknown cache mode, a missing lock file.
    """
    if dockerfile and template:
        raise ImageBuildError("give either --template or --dockerfile, not both")
    if dockerfile and base:
        raise ImageBuildError("--base does not apply to a Dockerfile: its FROM line is the base")
    if mode not in CACHE_MODES:
        raise ImageBuildError(f"unknown cache mode {mode!r}; choose one of {', '.join(CACHE_MODES)}")
    project_root = Path(project_root).resolve()
    st = ImageStore(Path(store) if store else default_store())
    templates_dir = Path(templates_dir)
    user_vars = dict(variables or {})
    lock_paths = [Path(p).resolve() for p in lock_files] or [project_root / f for f in DEFAULT_LOCK_FILES
                                                              if (project_root / f).exists()]
    template_name = None if dockerfile else (template or DEFAULT_TEMPLATE)
    name = name or ("prorl-exec" if template_name == DEFAULT_TEMPLATE else
                    template_name or Path(dockerfile).resolve().parent.name or "image")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ImageBuildError(f"image name {name!r}: use letters, digits, '.', '_' and '-'")
    staging = st.staging_dir(name) / "prorl-src"
    needs_source = exec_server
    if needs_source and not (project_root / "setup.cfg").exists() and not (project_root / "pyproject.toml").exists():
        raise ImageBuildError(f"project source not found at {project_root} (an image holds this project's "
                              "execution server): run from a checkout or pass --project-root")

    if dockerfile:
        defaults = template_defaults("_dockerfile", templates_dir)
        layer_vars = {**defaults, **user_vars}
        post = None
        files: list[tuple[str, str]] = []
        env_lines: list[str] = []
        if exec_server:
            env = _environment(templates_dir)
            try:
                post = env.get_template("_exec_server_post.sh.j2").render(**layer_vars)
            except jinja2.UndefinedError as e:
                raise TemplateVariableMissing(f"execution-server layer: {e.message}: pass --set NAME=VALUE") from None
            files = [(str(staging), layer_vars["project_dest"])]
            env_lines = [f"PRORL_EXEC_PYTHON={layer_vars['venv']}/bin/python"]  # the writer adds "export"
        definition, base_img = dockerfile_to_definition(Path(dockerfile), post, files, env_lines)
        source = f"Dockerfile {Path(dockerfile).resolve()}"
        cwd = Path(dockerfile).resolve().parent
    else:
        base_img = parse_base(base or DEFAULT_BASE)
        variables = {**template_defaults(template_name, templates_dir), **user_vars,
                     "base_bootstrap": base_img.bootstrap, "base_from": base_img.source,
                     "image_name": name, "project_src": str(staging)}
        definition = render_template(template_name, variables, templates_dir)
        source = f"template {template_name} ({templates_dir / (template_name + '.def.j2')})"
        cwd = st.root

    source_hash = tree_hash(project_root, PROJECT_FILES + PROJECT_PACKAGES) if needs_source else ""
    key, inputs = cache_key(mode, definition, base_identity(base_img), project_version(project_root),
                            source_hash, files_digest(lock_paths) if mode in ("lock", "scratch") else {})
    image_path = Path(output).expanduser().resolve() if output else st.image_path(name, key)
    def_path = st.def_path(name, key)
    if mode == "scratch":
        found, reason = None, "cache mode scratch always rebuilds"
    else:
        found, reason = st.lookup(name, mode, key)
        if found and output and found != image_path:
            found, reason = None, f"{reason}, but --output asks for {image_path}"
    try:
        builder_path, builder_found = find_builder(builder), True
    except BuilderNotFound:
        builder_path, builder_found = builder or BUILDERS[0], False
    cmd = build_command(builder_path, image_path, def_path, fakeroot, extra_build_args)
    return BuildPlan(name=name, source=source, base=base_img, definition=definition, mode=mode, key=key,
                     key_inputs=inputs, store=st, image_path=found or image_path, def_path=def_path, cwd=cwd,
                     command=cmd, decision="reuse" if found else "build", reason=reason,
                     builder_found=builder_found, stage_from=project_root if needs_source else None,
                     stage_to=staging if needs_source else None)


def execute_plan(plan: BuildPlan, check_base: bool = True, timeout_s: Optional[float] = None,
                 log=print) -> Path:
    """Build (or reuse) the image of ``plan``; return the image path.

    Order: builder present (else :class:`BuilderNotFound`), base reachable (else
    :class:`BaseImageUnreachable`), reuse when the cache allows, else stage the source, write the definition,
    run the builder (its output streams to stderr), write the key file, record the image in the index.
    A failed build leaves no index entry and no key file. Raises :class:`BuildFailed` when the builder fails.
    """
    if plan.decision == "reuse":
        log(f"reuse {plan.image_path} ({plan.reason})")
        return plan.image_path
    if not plan.builder_found:
        find_builder(None if Path(plan.command[0]).name in BUILDERS else plan.command[0])  # raises
    if check_base:
        log(check_base_reachable(plan.base))
    if plan.stage_from and plan.stage_to:
        stage_project(plan.stage_from, plan.stage_to)
    plan.def_path.parent.mkdir(parents=True, exist_ok=True)
    plan.def_path.write_text(plan.definition)
    plan.image_path.parent.mkdir(parents=True, exist_ok=True)
    Path(str(plan.image_path) + KEY_SUFFIX).unlink(missing_ok=True)
    log(f"building {plan.image_path}: {shlex.join(plan.command)}")
    proc = subprocess.run(plan.command, cwd=plan.cwd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True,
                          timeout=timeout_s)
    if proc.stderr:
        sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        if UNREACHABLE_PATTERNS.search(proc.stderr or ""):
            raise BaseImageUnreachable(f"base image {plan.base.ref} could not be fetched by the builder:\n{tail}")
        raise BuildFailed(f"{Path(plan.command[0]).name} build failed (exit {proc.returncode}):\n{tail}")
    if not plan.image_path.is_file():
        raise BuildFailed(f"{Path(plan.command[0]).name} build exited 0 but wrote no {plan.image_path}")
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    key_doc = {"key": plan.key, "mode": plan.mode, "inputs": plan.key_inputs, "name": plan.name,
               "definition": str(plan.def_path), "command": plan.command, "created": created}
    Path(str(plan.image_path) + KEY_SUFFIX).write_text(json.dumps(key_doc, indent=2) + "\n")
    plan.store.record({"name": plan.name, "mode": plan.mode, "key": plan.key, "path": str(plan.image_path),
                       "base": plan.base.ref, "definition": str(plan.def_path), "created": created})
    log(f"built {plan.image_path}")
    return plan.image_path


# ------------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prorl-build-image",
        description="Build a Singularity/Apptainer image for ProRL sandboxes from a template or a Dockerfile. "
                    "With --dry-run alone: show the default execution-server image's plan.")
    src = p.add_argument_group("what to build")
    src.add_argument("--template", help=f"template name in the templates dir (default {DEFAULT_TEMPLATE})")
    src.add_argument("--dockerfile", type=Path, help="convert this Dockerfile (spython) instead of a template")
    src.add_argument("--base", help=f"base image: docker://..., localimage://PATH or PATH.sif (default {DEFAULT_BASE})")
    src.add_argument("--name", help="image name in the store (default prorl-exec for the default template)")
    src.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                     help="template variable (VALUE parsed as JSON when it is JSON); repeatable")
    src.add_argument("--vars", type=Path, help="JSON file of template variables (--set wins)")
    src.add_argument("--no-exec-server", action="store_true",
                     help="Dockerfile only: do not add the execution-server layer")
    src.add_argument("--templates-dir", type=Path,
                     default=Path(os.environ.get("PRORL_TEMPLATES_DIR", DEFAULT_TEMPLATES_DIR)))
    src.add_argument("--project-root", type=Path, default=REPO_ROOT, help="this project's checkout")
    src.add_argument("--list-templates", action="store_true", help="print the template names and exit")
    cache = p.add_argument_group("cache")
    cache.add_argument("--cache", choices=CACHE_MODES, default="versioned", help="cache mode (default versioned)")
    cache.add_argument("--lock", action="append", type=Path, default=[],
                       help="dependency lock file for --cache lock (repeatable; default setup.cfg, pyproject.toml)")
    cache.add_argument("--store", type=Path, help="image store dir (default $PRORL_IMAGE_STORE or ~/.cache/prorl/images)")
    cache.add_argument("--output", type=Path, help="write the image here instead of the store's images/ dir")
    b = p.add_argument_group("build")
    b.add_argument("--builder", help="apptainer, singularity, or a path (default: whichever is on PATH)")
    b.add_argument("--fakeroot", action="store_true", help="build with --fakeroot (no root needed)")
    b.add_argument("--build-arg", action="append", default=[], dest="build_args", metavar="ARG",
                   help="extra argument for the builder's build command; repeatable")
    b.add_argument("--check-base", dest="check_base", action="store_true", default=None,
                   help="check that the base image is reachable (default: on for builds, off for --dry-run)")
    b.add_argument("--no-check-base", dest="check_base", action="store_false")
    b.add_argument("--dry-run", action="store_true", help="print definition, cache decision and command; build nothing")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.list_templates:
            for t in list_templates(args.templates_dir):
                print(t)
            return 0
        variables: dict[str, Any] = {}
        if args.vars:
            try:
                variables.update(json.loads(args.vars.read_text()))
            except (OSError, json.JSONDecodeError) as e:
                raise ImageBuildError(f"--vars {args.vars}: {e}") from None
        variables.update(parse_set(args.set))
        plan = plan_build(template=args.template, dockerfile=args.dockerfile, base=args.base, name=args.name,
                          variables=variables, mode=args.cache, lock_files=args.lock, store=args.store,
                          output=args.output, builder=args.builder, fakeroot=args.fakeroot,
                          extra_build_args=args.build_args, templates_dir=args.templates_dir,
                          project_root=args.project_root, exec_server=not args.no_exec_server)
        if args.dry_run:
            if args.check_base:
                plan.base_check = check_base_reachable(plan.base)
            elif plan.base.is_local:
                plan.base_check = check_base_reachable(plan.base)  # cheap, and a dry run should catch it
            sys.stdout.write(plan.describe())
            return 0
        print(execute_plan(plan, check_base=args.check_base is not False, log=lambda m: print(m, file=sys.stderr)))
        return 0
    except ImageBuildError as e:
        print(f"prorl-build-image: error: {e}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired as e:
        print(f"prorl-build-image: error: build timed out after {e.timeout} s", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
