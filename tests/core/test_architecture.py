"""The import graph keeps the layers: no module imports a higher layer, and no two modules import each other.

Layers, lowest first (a module may import its own layer's package and any lower layer):

    0  sandbox, singularity    each standalone: neither imports the other nor anything of the project
    1  prorl_server.types      the wire models: pydantic and the standard library only
    2  prorl_server            the server (finds handlers only through entry points)
    3  handlers
    4  trainer_plugins

Every ``import`` and ``from ... import`` of every ``.py`` file of those packages counts, function-local ones
included, and those under ``if TYPE_CHECKING:`` too: an import made for annotations only is still a dependency
of the design, and a circle of them (a job that names its handler's type while the handler API names the job's)
is the circle a reader has to untangle (issue #27). Relative imports are resolved; ``from package import name`` is an edge to ``package.name`` when that is a module, else to
``package``. The graph is read with the standard library's ``ast``: nothing is imported.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sandbox", "singularity", "prorl_server", "handlers", "trainer_plugins")
#: What ``prorl_server.types`` may import besides the standard library.
TYPES_MAY_IMPORT = {"pydantic", "pydantic_core", "annotated_types", "typing_extensions"}


def layer(module: str) -> tuple[int, str]:
    """(rank, component) of a project module; modules of one component may import each other."""
    top = module.split(".")[0]
    if top in ("sandbox", "singularity"):
        return 0, top
    if module == "prorl_server.types" or module.startswith("prorl_server.types."):
        return 1, "prorl_server.types"
    return {"prorl_server": (2, top), "handlers": (3, top), "trainer_plugins": (4, top)}[top]


@dataclass
class Graph:
    root: Path
    modules: dict[str, Path] = field(default_factory=dict)
    #: importer → {imported project module: first line}
    edges: dict[str, dict[str, int]] = field(default_factory=dict)
    #: importer → {top-level name of an outside module: first line}
    outside: dict[str, dict[str, int]] = field(default_factory=dict)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, ``if TYPE_CHECKING:`` bodies included."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def build_graph(root: Path, packages: Iterable[str]) -> Graph:
    g = Graph(root)
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            g.modules[module_name(root, path)] = path
    for mod, path in g.modules.items():
        is_package = path.name == "__init__.py"
        edges, outside = g.edges.setdefault(mod, {}), g.outside.setdefault(mod, {})

        def add(target: str, line: int) -> None:
            if target in g.modules:
                if target != mod:
                    edges.setdefault(target, line)
            elif target.split(".")[0] not in packages:
                outside.setdefault(target.split(".")[0], line)
            else:  # a project name that is no module here (a missing module): the nearest package that is
                parent = target.rsplit(".", 1)[0] if "." in target else target
                if parent in g.modules and parent != mod:
                    edges.setdefault(parent, line)

        for node in sorted(_imports(ast.parse(path.read_text(), str(path))), key=lambda n: n.lineno):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
                continue
            if node.level:
                base = mod.split(".") if is_package else mod.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                add(sub if sub in g.modules else target, node.lineno)
    return g


def layer_violations(g: Graph) -> list[str]:
    out = []
    for mod, targets in sorted(g.edges.items()):
        rank, component = layer(mod)
        where = g.modules[mod].relative_to(g.root)
        for target, line in sorted(targets.items()):
            t_rank, t_component = layer(target)
            if t_component == component:
                continue
            if t_rank > rank:
                out.append(f"{where}:{line}: {mod} (layer {component}) imports "
                           f"{target} (higher layer {t_component})")
            elif rank <= 1:  # the standalone layers import nothing of the project but their own component
                out.append(f"{where}:{line}: {mod} ({component} imports only "
                           f"{'pydantic and the standard library' if rank else 'itself'}) imports {target}")
        if layer(mod)[0] == 1:
            for name, line in sorted(g.outside.get(mod, {}).items()):
                if name not in sys.stdlib_module_names and name not in TYPES_MAY_IMPORT:
                    out.append(f"{where}:{line}: {mod} imports {name} "
                               f"(only pydantic and the standard library)")
    return out


def cycles(g: Graph) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    sccs: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:  # iterative would be longer; the graph is a few hundred modules deep
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in g.edges.get(v, {}):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(g.edges):
        if v not in index:
            strongconnect(v)
    return [_a_cycle(g, comp) for comp in sorted(sccs)]


def _a_cycle(g: Graph, comp: list[str]) -> list[str]:
    """The shortest cycle through the component's first module (breadth-first inside the component)."""
    members, start = set(comp), comp[0]
    parent: dict[str, Optional[str]] = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(g.edges.get(v, {})):
            if w == start:
                path = [v]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w in members and w not in parent:
                parent[w] = v
                queue.append(w)
    return comp  # unreachable for a strongly connected component


def describe_cycle(g: Graph, cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {g.edges[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


# ------------------------------------------------------------------------------------------ the project


def test_no_module_imports_a_higher_layer():
    g = build_graph(ROOT, PACKAGES)
    assert len(g.modules) > 50 and sum(map(len, g.edges.values())) > 100, "the scan found too little"
    found = layer_violations(g)
    print("\n".join(["layer violations:", *found]) if found else "no layer violations")
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_no_import_cycles_between_modules():
    g = build_graph(ROOT, PACKAGES)
    found = [describe_cycle(g, c) for c in cycles(g)]
    print("\n".join(["import cycles:", *found]) if found else "no import cycles")
    assert not found, ("import cycles (annotation-only imports count; break each: let the lower module name what "
                       "it needs of the higher one as a Protocol, or inject it):\n" + "\n".join(found))


# ------------------------------------------------------------------------------------------ the checker itself


def _tree(tmp_path: Path, files: dict[str, str]) -> Graph:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return build_graph(tmp_path, PACKAGES)


def test_checker_resolves_relative_and_local_imports_and_counts_type_checking_ones(tmp_path):
    g = _tree(tmp_path, {
        "sandbox/__init__.py": "",
        "sandbox/a.py": "from . import b\nfrom .c import thing\n",
        "sandbox/b.py": "def f():\n    from sandbox import a\n",
        "sandbox/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\nelse:\n"
                        "    import json\n",
        "prorl_server/__init__.py": "",
        "prorl_server/types.py": "import pydantic\nimport json\nimport numpy\n",
        "prorl_server/app.py": "import handlers.h\nfrom .types import M\nfrom prorl_server import types\n",
        "prorl_server/sub/__init__.py": "from .. import app\nfrom ..sub import deep\n",
        "prorl_server/sub/deep.py": "",
        "handlers/__init__.py": "",
        "handlers/h.py": "import sandbox.a\nimport trainer_plugins\n",
        "trainer_plugins/__init__.py": "import handlers.h\nfrom prorl_server.app import create_app\n",
        "singularity/__init__.py": "import sandbox\n",
    })
    assert g.edges["sandbox.a"] == {"sandbox.b": 1, "sandbox.c": 2}
    assert g.edges["sandbox.b"] == {"sandbox.a": 2}  # function-local
    assert g.edges["sandbox.c"] == {"sandbox.a": 3} and g.outside["sandbox.c"] == {"typing": 1, "json": 5}
    assert g.edges["prorl_server.app"] == {"handlers.h": 1, "prorl_server.types": 2}
    assert g.edges["prorl_server.sub"] == {"prorl_server.app": 1, "prorl_server.sub.deep": 2}
    assert g.edges["trainer_plugins"] == {"handlers.h": 1, "prorl_server.app": 2}

    assert layer_violations(g) == [
        "handlers/h.py:2: handlers.h (layer handlers) imports trainer_plugins (higher layer trainer_plugins)",
        "prorl_server/app.py:1: prorl_server.app (layer prorl_server) imports handlers.h (higher layer handlers)",
        "prorl_server/types.py:3: prorl_server.types imports numpy (only pydantic and the standard library)",
        "singularity/__init__.py:1: singularity (singularity imports only itself) imports sandbox",
    ]
    assert cycles(g) == [["handlers.h", "trainer_plugins", "handlers.h"], ["sandbox.a", "sandbox.b", "sandbox.a"]]
    assert describe_cycle(g, cycles(g)[1]) == "sandbox.a (line 1) -> sandbox.b (line 2) -> sandbox.a"


def test_checker_finds_a_long_cycle_and_the_types_layer_importing_the_server(tmp_path):
    g = _tree(tmp_path, {
        "prorl_server/__init__.py": "",
        "prorl_server/types.py": "from prorl_server.x import Y\nfrom sandbox.spec import S\n",
        "prorl_server/x.py": "from prorl_server import y\n",
        "prorl_server/y.py": "from prorl_server.z import q\n",
        "prorl_server/z.py": "from . import x\n",
        "sandbox/__init__.py": "",
        "sandbox/spec.py": "",
    })
    assert cycles(g) == [["prorl_server.x", "prorl_server.y", "prorl_server.z", "prorl_server.x"]]
    assert layer_violations(g) == [
        "prorl_server/types.py:1: prorl_server.types (layer prorl_server.types) imports prorl_server.x "
        "(higher layer prorl_server)",
        "prorl_server/types.py:2: prorl_server.types (prorl_server.types imports only pydantic and the standard "
        "library) imports sandbox.spec",
    ]
