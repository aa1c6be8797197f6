"""The package's floors: every import in pdserve/ runs down (or sideways within a floor) the order in
`LAYERS`, and no set of modules imports itself around in a cycle. Imports inside functions and under
`TYPE_CHECKING` count too: a lazy import hides a dependency from the import system, not from a reader.
The walk reads the source with `ast`, so it imports nothing."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

from pdserve import config
from pdserve.config import KV_TRANSFER_BACKENDS, SCHEDULER_POLICIES

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "pdserve"

# Top to bottom. A module may import modules on its own floor or below, never above. A module belongs to
# the longest prefix listed here ("pdserve" alone is the package's facade, `pdserve/__init__.py`).
LAYERS: tuple[tuple[str, ...], ...] = (
    # entry points: the facade, the CLI, benchmark clients, `pdserve top`, the simulator (it drives the engine loop)
    ("pdserve", "pdserve.cli", "pdserve.bench", "pdserve.dashboard", "pdserve.sim.simulator", "pdserve.sim.planner"),
    ("pdserve.router",),  # the disaggregation front: HTTP only, no engine
    ("pdserve.server",),  # the OpenAI HTTP front of one instance
    ("pdserve.engine", "pdserve.spec"),  # the engine loop, its builder, its own process; speculation around its executor
    ("pdserve.scheduler", "pdserve.runner", "pdserve.sim"),  # control plane / data plane of one step
    ("pdserve.model", "pdserve.attention"),
    ("pdserve.kv", "pdserve.transfer"),  # the KV cache and how it moves between instances
    ("pdserve.config", "pdserve.registry", "pdserve.extensions", "pdserve.memory", "pdserve.request", "pdserve.batch", "pdserve.outputs", "pdserve.errors", "pdserve.structured", "pdserve.tools"),
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The modules of `known` that `path` (module `module`) imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package (or one above per extra dot)
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # `from pkg import mod` imports the module pkg.mod when there is one
            found.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known)
    return {name for name in found if name in known and name != module}


def import_graph(root: Path) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(paths)
    return {name: imports_of(path, name, known) for name, path in paths.items()}


def layer_of(module: str, layers: Iterable[Iterable[str]]) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, floor)
    for floor, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), floor)
    return None if best is None else best[1]


def upward_imports(graph: Mapping[str, set[str]], layers: Iterable[Iterable[str]]) -> list[str]:
    layers = [tuple(floor) for floor in layers]
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            own, theirs = layer_of(module, layers), layer_of(target, layers)
            if own is not None and theirs is not None and theirs < own:
                bad.append(f"{module} (floor {own}) imports {target} (floor {theirs})")
    return bad


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# --- the package itself


def test_every_module_is_on_a_floor():
    unplaced = [m for m in import_graph(PACKAGE_ROOT) if layer_of(m, LAYERS) is None]
    assert unplaced == [], f"add these modules' packages to LAYERS: {unplaced}"


def test_no_import_runs_up():
    assert upward_imports(import_graph(PACKAGE_ROOT), LAYERS) == []


def test_no_import_cycle():
    assert cycles(import_graph(PACKAGE_ROOT)) == []


def test_registries_match_the_names_config_accepts():
    # config spells the names so it need not import the registries above it; these must not drift apart
    from pdserve.scheduler.policies import POLICIES
    from pdserve.transfer.registry import TRANSPORTS

    assert sorted(POLICIES) == sorted(SCHEDULER_POLICIES)
    assert sorted(TRANSPORTS) == sorted(KV_TRANSFER_BACKENDS)
    # The rest read from the source, so this test imports no torch.
    found = registries_in(PACKAGE_ROOT)
    assert sorted(found["pdserve.attention.base.ATTENTION_BACKENDS"]) == sorted(config.ATTENTION_BACKENDS)
    assert sorted(found["pdserve.router.policies.POLICIES"]) == sorted(config.ROUTER_POLICIES)
    assert sorted(found["pdserve.bench.serve_bench.DATASETS"]) == sorted(config.BENCH_DATASETS)
    assert module_constant(PACKAGE_ROOT / "model" / "linear.py", "LINEAR_KINDS") == config.LINEAR_KERNELS
    assert set(found) >= {"pdserve.scheduler.policies.POLICIES", "pdserve.transfer.registry.TRANSPORTS"}


def test_every_registry_entry_names_a_definition():
    """Each "module:attr" of every `Registry(...)` in the package is a module here that defines attr at
    its top level: a typo fails now, not at the first request that asks for that name."""
    found = registries_in(PACKAGE_ROOT)
    assert len(found) >= 4
    for registry, entries in found.items():
        for name, target in entries.items():
            module, _, attr = target.partition(":")
            path = PACKAGE_ROOT.parent.joinpath(*module.split(".")).with_suffix(".py")
            assert path.is_file(), f"{registry}[{name!r}]: no module {module}"
            assert attr in top_level_names(path), f"{registry}[{name!r}]: {module} defines no {attr}"


def registries_in(root: Path) -> dict[str, dict[str, str]]:
    """Every module-level `NAME = Registry("kind", {...})` (annotated or not), read with `ast`:
    "module.NAME" -> its entries."""
    out: dict[str, dict[str, str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            target, value = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign):
                target, value = node.target, node.value
            if not (isinstance(target, ast.Name) and isinstance(value, ast.Call)):
                continue
            if isinstance(value.func, ast.Name) and value.func.id == "Registry" and len(value.args) == 2:
                out[f"{module_name(path, root)}.{target.id}"] = ast.literal_eval(value.args[1])
    return out


def top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def module_constant(path: Path, name: str) -> object:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} has no constant {name}")


# --- the checker on a made-up tree, so a broken walk cannot pass silently


def _write(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_an_upward_import_in_a_function_and_a_relative_one(tmp_path):
    root = tmp_path / "pkg"
    _write(root, {
        "__init__.py": "",
        "config.py": "def check():\n    from pkg.top.app import X\n",
        "top/__init__.py": "",
        "top/app.py": "from pkg import config\nX = 1\n",
        "low/__init__.py": "",
        "low/a.py": "from ..top import app\n",
    })
    graph = import_graph(root)
    assert graph["pkg.config"] == {"pkg.top.app"}
    assert graph["pkg.low.a"] == {"pkg.top", "pkg.top.app"}
    layers = (("pkg", "pkg.top"), ("pkg.low",), ("pkg.config",))
    assert upward_imports(graph, layers) == [
        "pkg.config (floor 2) imports pkg.top.app (floor 0)",
        "pkg.low.a (floor 1) imports pkg.top (floor 0)",
        "pkg.low.a (floor 1) imports pkg.top.app (floor 0)",
    ]
    assert cycles(graph) == [["pkg.config", "pkg.top.app"]]


def test_checker_passes_a_clean_tree_and_sideways_imports(tmp_path):
    root = tmp_path / "pkg"
    _write(root, {
        "__init__.py": "",
        "a/__init__.py": "from pkg.a.x import f\n",
        "a/x.py": "import pkg.b.y\ndef f():\n    pass\n",
        "b/__init__.py": "",
        "b/y.py": "from pkg.c import z\n",
        "c/__init__.py": "",
        "c/z.py": "import os\n",
    })
    graph = import_graph(root)
    layers = (("pkg.a", "pkg.b"), ("pkg.c",))
    assert upward_imports(graph, layers) == []
    assert cycles(graph) == []
    assert layer_of("pkg.b.y", layers) == 0 and layer_of("pkg.other", layers) is None
