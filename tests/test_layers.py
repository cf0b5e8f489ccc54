"""The house's shape: spec_cli's packages are layers, each importing only from itself and the layers below, and no
module imports, even inside a function, one that imports it back (an import circle). Read from the source: every
`import`, at the top of a module or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import spec_cli

ROOT = Path(spec_cli.__file__).parent
# bottom to top; a module's layer is its package's (the front ends: everything else)
LAYERS = ["core", "exec", "models", "draft2", "decoding", "engine", "front"]


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(("spec_cli",) + parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The spec_cli modules `path` imports, anywhere in it (a package's `from p import m`: the module m)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("spec_cli"):
                continue
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("spec_cli") and a.name in known)
    return {m for m in out if m in known}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "core"  # (the package itself: its version)
    return parts[1] if parts[1] in LAYERS else "front"


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def test_each_layer_imports_only_itself_and_the_layers_below():
    upward = [f"{m} ({layer(m)}) imports {d} ({layer(d)})" for m, deps in graph().items() for d in deps
              if LAYERS.index(layer(d)) > LAYERS.index(layer(m))]
    assert upward == []


def test_no_import_circles():
    deps = graph()
    # a package's __init__ importing its own modules is how a package presents them: not a circle's edge
    deps = {m: {d for d in ds if not (m in deps and d.startswith(m + "."))} for m, ds in deps.items()}
    circles, state = [], {}

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for d in sorted(deps[m]):
            if state.get(d) == 1:
                circles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(deps):
        if m not in state:
            visit(m, [])
    assert circles == []


def test_the_test_sees_the_layers():
    """The reader finds what it should: lazy imports too, and every package's modules."""
    deps = graph()
    assert "spec_cli.exec.runner" in deps["spec_cli.engine"] or "spec_cli.exec" in deps["spec_cli.engine"]
    assert {"core", "exec", "models", "draft2", "decoding", "engine", "front"} == {layer(m) for m in deps}
    assert "spec_cli.models.gguf" in deps["spec_cli.models.loading"]  # (imported inside a function)
