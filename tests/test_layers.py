"""The import graph keeps the layer order of docs/architecture.md's layout (section 1): every specrt module's
imports (parsed with ast, lazy ones inside functions included) point down the list of layers (a
layer: a folder, or a root module), inside the packages with an order of their own down that
order too, and no modules import each other in a loop. The bench/ package sits above the runtime
and uses only its public names."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom first; a module may import only modules of its own unit or of units listed before it.
# A unit is a subpackage or a root module of specrt; "specrt" alone holds the FACADE's modules.
LAYERS = [
    "specrt.ops",           # the kernels: the compiled extension (csrc/, PART_OF) and their Python front, and
                            # beside them the pure-torch oracle (ops.reference)
    "specrt.structured",    # structured output's records, grammars and closing within the token budget
    "specrt.config",        # SpecConfig, SamplingParams
    "specrt.observability",  # metrics and the healthy ranges they are judged against
    "specrt.sampling",      # the sampling transform of draft and target rows, its controls, log-probabilities
    "specrt.models",        # the models, their attention metadata and KV cache, where an engine's models come from
    "specrt.drafters",
    "specrt.policy",        # draft length
    "specrt.step",          # one speculative step: its parts and the engine that wires them (INNER below)
    "specrt",               # the public face (FACADE)
    "specrt.server",
    "specrt.training",
    "specrt.cli",           # the specrt command and its demo
    "bench",
]

# Modules that belong to a layer they are not named under: the extension is the ops layer's compiled core
# (test_only_ops_imports_the_extension: ops.library alone loads it).
PART_OF = {"specrt._C": "specrt.ops"}

# The root modules of the "specrt" layer: the package's lazy names and the LLM class they lead to.
FACADE = {"specrt", "specrt.llm"}

# Inside a package listed here its modules keep an order of their own, bottom first ("" is the package's __init__).
INNER = {
    "specrt.structured": ["closing", ""],
    "specrt.sampling": ["", "controls", "transform", "logprobs"],
    "specrt.step": ["", "threads", "calibration", "warmup", "scheduler", "verify", "prefill", "intake", "overlap",
                    "commit", "accounting", "engine", "distributed"],
}

# Upward imports allowed, each lazy (inside a function) and named in docs/architecture.md's layout (section 1).
ALLOWED_UPWARD = {
    ("specrt.cli", "bench.cli"),    # `specrt bench` dispatches to the source checkout's bench/ package
}


def _modules(package: str) -> dict[str, Path]:
    mods = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = {**_modules("specrt"), **_modules("bench")}


def _resolve(name: str) -> str | None:
    """The module a dotted import name lands in (specrt._C is the compiled extension)."""
    if name == "specrt._C":
        return name
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _dynamic_target(node: ast.Call) -> str | None:
    """importlib.import_module("x") / __import__("x") with a constant name."""
    f = node.func
    named = (isinstance(f, ast.Name) and f.id == "__import__") or \
        (isinstance(f, ast.Attribute) and f.attr == "import_module")
    if named and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def _import_names(module: str, path: Path, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
        # `from a import b` imports module a.b when there is one, else a name of a
        return [f"{base}.{a.name}" if _resolve(f"{base}.{a.name}") == f"{base}.{a.name}" else base
                for a in node.names]
    if isinstance(node, ast.Call):
        target = _dynamic_target(node)
        return [target] if target else []
    return []


def edges() -> list[tuple[str, str, int, bool]]:
    """(importer, imported, line, lazy) for every import between specrt/bench modules."""
    out = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        lazy = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                for n in ast.walk(f)}
        for node in ast.walk(tree):
            for name in _import_names(module, path, node):
                if not name.startswith(("specrt", "bench")):
                    continue
                target = _resolve(name)
                if target is not None and target != module:
                    out.append((module, target, node.lineno, id(node) in lazy))
    return out


def unit(module: str) -> str:
    """The LAYERS entry a module belongs to (its longest listed prefix)."""
    module = PART_OF.get(module, module)
    best = max((u for u in LAYERS if module == u or module.startswith(u + ".")), key=len, default=None)
    assert best is not None and (best != "specrt" or module in FACADE), \
        f"{module} is in no layer: add it to LAYERS and docs/architecture.md's layout"
    return best


def test_every_module_has_a_layer():
    for module in MODULES:
        unit(module)


def test_imports_point_down_the_layers():
    rank = {u: i for i, u in enumerate(LAYERS)}
    upward = []
    for src, dst, line, lazy in edges():
        if rank[unit(dst)] > rank[unit(src)]:
            if lazy and (src, dst) in ALLOWED_UPWARD:
                continue
            upward.append(f"{MODULES[src].relative_to(ROOT)}:{line} imports {dst} ({unit(src)} -> {unit(dst)}"
                          f"{', lazy' if lazy else ''})")
    assert not upward, "imports pointing up the layer list:\n" + "\n".join(upward)


def inner_rank(package: str, module: str) -> int:
    """Where a module of an INNER package sits in that package's own order."""
    name = module.removeprefix(package).removeprefix(".").split(".")[0]
    assert name in INNER[package], f"{module} is not in INNER[{package!r}]: add it there and to docs/architecture.md"
    return INNER[package].index(name)


def test_imports_inside_a_package_point_down_its_order():
    for package, order in INNER.items():
        assert set(order) == {m.removeprefix(package).removeprefix(".").split(".")[0]
                              for m in MODULES if unit(m) == package}, f"INNER[{package!r}] lists other modules"
    upward = [f"{MODULES[src].relative_to(ROOT)}:{line} imports {dst}"
              for src, dst, line, _ in edges()
              if unit(src) == unit(dst) in INNER and inner_rank(unit(dst), dst) > inner_rank(unit(src), src)]
    assert not upward, "imports pointing up a package's own order:\n" + "\n".join(upward)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}     # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_loops():
    graph: dict[str, set[str]] = {}
    for src, dst, _, lazy in edges():
        if not (lazy and (src, dst) in ALLOWED_UPWARD):
            graph.setdefault(src, set()).add(dst)
    cycle = _find_cycle(graph)
    assert cycle is None, "import loop: " + " -> ".join(cycle)


def test_only_ops_imports_the_extension():
    importers = sorted({s for s, d, _, _ in edges() if d == "specrt._C"})
    assert importers == ["specrt.ops.library"], importers    # one module of the ops package loads it


def test_cycle_finder_finds_loops():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_checker_sees_lazy_relative_and_dynamic_imports():
    """The parser must catch the imports it is meant to police (else every test above passes vacuously)."""
    found = {(s, d): lazy for s, d, _, lazy in edges()}
    assert found[("specrt.step.engine", "specrt.step.scheduler")] is False
    assert found[("specrt.cli", "bench.cli")] is True              # importlib.import_module, in a function
    assert ("specrt.ops.library", "specrt._C") in found
    assert any(s == "specrt.cli" and d == "specrt.server" for s, d in found)     # __import__("specrt.server")


def test_architecture_layout_names_every_layer():
    layout = (ROOT / "docs" / "architecture.md").read_text().split("## 1. Layers", 1)[1].split("\n## ", 1)[0]
    for u in LAYERS:
        if u in ("specrt", "specrt._C"):
            continue
        shown = u.replace(".", "/") + ("/" if (ROOT / u.replace(".", "/")).is_dir() else ".py")
        assert shown.removeprefix("specrt/") in layout or shown in layout, f"{shown} missing from docs/architecture.md's layout"
    named = [m.replace(".", "/") + ".py" for m in FACADE - {"specrt"}] + \
        [f"{name}.py" for order in INNER.values() for name in order if name]
    assert not [f for f in named if f not in layout], "missing from docs/architecture.md's layout"
    assert "lazy" in layout and "specrt bench" in layout      # the allowed upward import is documented


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specrt"):
            bad += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            # self / cls, and torch's own underscore API (torch._weight_int8pack_mm) are fine
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "torch")):
                bad.append(f"line {node.lineno}: reads .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "__new__":
            bad.append(f"line {node.lineno}: calls __new__")
    return bad


@pytest.mark.parametrize("path", sorted((ROOT / "bench").glob("*.py")), ids=lambda p: p.name)
def test_bench_uses_public_names_only(path):
    """Benchmarks use public hooks: no private attribute of another object, no private import."""
    assert not _private_uses(path), _private_uses(path)
