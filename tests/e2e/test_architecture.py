"""The shape of the code, checked by walking its syntax trees (no import runs).

Layers, lowest first. A module may import from its own package, from the layers below its own,
and from nothing above; two packages of one layer do not import each other (the model runtime and
consensus know nothing of one another, nor do the two roles). Every `import` counts, at any depth
(a deferred import inside a function is still a dependency).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[2]

LAYERS: list[tuple[str, ...]] = [
    ("kvbridge",),  # the package itself: its __init__ (the version) and nothing else
    ("kvbridge.v1",),  # generated stubs of proto/kvbridge/v1
    ("kvbridge.common",),  # rpc, logs, security, limits, metrics plumbing, net, progress, text
    ("kvbridge.engine", "kvbridge.consensus"),  # the model runtime; ring agreement (pure)
    ("kvbridge.kv_transfer",),  # moving KV pages between the runtime's pools
    ("kvbridge.pipeline",),  # the PP runtime: rank processes, rank 0's loop, stage loops, control channel
    ("kvbridge.serving",),  # a node's gRPC server, Admin, its front, wire adapters, the colocated node
    ("kvbridge.prefill_node", "kvbridge.decode_node"),  # the roles
    ("kvbridge.elastic_node",),  # a node of every role, one at a time
    ("kvbridge.router",),  # the front door (speaks to nodes over gRPC only)
    ("kvbridge.nodes",),  # ROLES and start_node: the one way to build a node
    ("kvbridge.bench",),  # benchmarks (start fleets in-process or as child processes)
    ("kvbridge.demo", "kvbridge.admin_cli"),  # commands: the demo, the admin client
    ("kvbridge.cli",),  # the `kvbridge` command and its subcommands
    ("kvbridge.__main__",),  # python -m kvbridge
]
# where each package's files are: the owner's folders sit at the repository's top and are installed
# inside `kvbridge` (pyproject.toml [tool.setuptools.package-dir])
FOLDERS = {
    "kvbridge": "kvbridge",
    **{f"kvbridge.{top}": top for top in ("common", "engine", "consensus", "kv_transfer", "pipeline",
                                           "serving", "prefill_node", "decode_node", "elastic_node", "router")},
}  # fmt: skip
MAX_LINES = 500


def package_of(module: str) -> str:
    """The longest layer entry `module` belongs to ("kvbridge.v1.admin_pb2" -> "kvbridge.v1")."""
    best = ""
    for layer in LAYERS:
        for pkg in layer:
            if (module == pkg or module.startswith(pkg + ".")) and len(pkg) > len(best):
                best = pkg
    return best


LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def product_files() -> dict[str, pathlib.Path]:
    """module name -> file, for every module of the installed package."""
    out = {}
    for package, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])
            out[name] = path
    return out


def imports_of(path: pathlib.Path, module: str) -> set[str]:
    """The product modules (and names in them) that `module` imports."""
    return {n for n in all_imports(path, module) if package_of(n)}


def all_imports(path: pathlib.Path, module: str) -> set[str]:
    """Every name `module` imports, at any depth, product or not (relative imports resolved)."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return names


def test_the_package_root_is_only_its_init_and_imports_nothing():
    """`kvbridge` is the bottom layer because its __init__ imports nothing; a module placed directly in
    it (not in a listed subpackage) would fall to that layer unseen, so there is none."""
    files = product_files()
    assert sorted(m for m in files if package_of(m) == "kvbridge") == ["kvbridge"]
    assert all_imports(files["kvbridge"], "kvbridge") == set()


def test_the_installed_packages_are_the_tree():
    """pyproject.toml lists every package of the tree (a folder left out would be missing from the
    wheel), each at the folder the layers above say."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {**{p: p.replace(".", "/") for p in ["kvbridge"]}, **setup["package-dir"]}
    assert mapped == {"kvbridge": "kvbridge", **{k: v for k, v in FOLDERS.items() if k != "kvbridge"}}
    tree = {m for m, path in product_files().items() if path.name == "__init__.py"}
    assert set(setup["packages"]) == tree


def test_the_layers_import_downward_only():
    files = product_files()
    assert len(files) > 100 and {package_of(m) for m in files} == set(LEVEL), "a package is outside the layers"
    wrong = []
    for module, path in sorted(files.items()):
        src = package_of(module)
        for target in sorted(imports_of(path, module)):
            dst = package_of(target)
            if dst == src:
                continue
            if LEVEL[dst] > LEVEL[src]:
                wrong.append(f"{module} imports {target}: {dst} is a layer above {src}")
            elif LEVEL[dst] == LEVEL[src]:
                wrong.append(f"{module} imports {target}: {src} and {dst} share a layer")
    assert wrong == []


def drawing() -> str:
    """The package-level import graph, top layer first: each package and the packages it imports
    (all below it). docs/architecture.md shows this drawing; the test below keeps the two equal."""
    files = product_files()
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in files.items():
        src = package_of(module)
        edges[src] |= {package_of(t) for t in imports_of(path, module)} - {src}
    short = lambda pkg: pkg.removeprefix("kvbridge.") if pkg != "kvbridge" else "kvbridge (__init__)"  # noqa: E731
    lines = []
    for layer in reversed(LAYERS):
        for pkg in layer:
            below = sorted(edges[pkg], key=lambda d: (-LEVEL[d], d))
            lines.append(f"{short(pkg):<14} -> {', '.join(map(short, below))}".rstrip(" ->"))
    return "\n".join(lines)


def test_the_drawing_in_the_docs_is_the_import_graph():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    start = doc.index("```imports\n") + len("```imports\n")
    assert doc[start : doc.index("\n```", start)] == drawing()


def reachable(roots: set[str], files: dict[str, pathlib.Path]) -> dict[str, str]:
    """Every product module an import of `roots` runs (a module's packages' __init__ included),
    each with the module that first imported it."""
    seen = {r: "" for r in roots}
    todo = list(roots)
    while todo:
        module = todo.pop()
        for name in all_imports(files[module], module):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in files and target not in seen:
                    seen[target] = module
                    todo.append(target)
    return seen


def test_the_router_runs_no_torch_and_no_node_internals():
    """The router (and the text layer it shares with the nodes) imports, at any depth and however
    deferred, nothing that imports torch, and nothing of engine/, serving/, pipeline/ or the roles:
    a router process never maps libtorch (tests/router/test_router_process.py checks a live one)."""
    files = product_files()
    roots = {m for m in files if m.startswith(("kvbridge.router", "kvbridge.common.text"))}
    reached = reachable(roots, files)
    assert len(reached) > 30
    torch = {m: reached[m] for m in reached if any(n.split(".")[0] == "torch" for n in all_imports(files[m], m))}
    assert torch == {}, "module: imported by"
    assert {package_of(m) for m in reached} == {"kvbridge", "kvbridge.v1", "kvbridge.common", "kvbridge.router"}


def test_the_layer_check_sees_a_wrong_import(tmp_path):
    """The walk above finds deferred and relative imports (a check that finds nothing proves nothing)."""
    bad = tmp_path / "loop.py"
    bad.write_text("def f():\n    from kvbridge.serving.front import NodeFront\n    from . import agent\n")
    found = imports_of(bad, "kvbridge.pipeline.loop")
    assert found == {
        "kvbridge.serving.front",
        "kvbridge.serving.front.NodeFront",
        "kvbridge.pipeline",
        "kvbridge.pipeline.agent",
    }


def test_no_product_file_is_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for m, p in product_files().items()
        if package_of(m) != "kvbridge.v1" and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_class_name_is_defined_twice():
    where = defaultdict(list)
    for m, path in product_files().items():
        if package_of(m) == "kvbridge.v1":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(m)
    assert {name: ms for name, ms in where.items() if len(ms) > 1} == {}


def test_no_module_is_loaded_by_a_string_name():
    found = []
    for m, path in product_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
                if name in ("import_module", "__import__", "spec_from_file_location", "load_module"):
                    found.append(f"{m}:{node.lineno} {name}")
    assert found == []


def test_every_imported_top_level_module_exists():
    """A rename that leaves `from backend import faults` behind is caught here, not when a rank
    process first imports the module."""
    import importlib.util

    missing = set()
    for module, path in product_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            missing |= {f"{module}: {n}" for n in names if importlib.util.find_spec(n.split(".")[0]) is None}
    assert missing == set()


def test_every_product_module_imports():
    """A moved module that `from pkg import module` still names is caught here (the walk above checks
    top-level names only), not when a node first starts."""
    modules = sorted(m for m in product_files() if not m.endswith("__main__"))
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)"
    subprocess.run([sys.executable, "-c", code, *modules], check=True, cwd=ROOT, timeout=300)
