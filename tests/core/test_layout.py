"""The house rules of the package tree: no import circles (module level or inside functions), no
module much over 800 lines, and every backend package with the same rooms for the same jobs."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ampbridge"
MAX_LINES = 800
ROOMS = ("environment", "layers", "plan", "trace", "apply", "loss_scale", "monitor", "schedule")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The ampbridge modules ``name`` imports anywhere in its body (relative or absolute)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles() -> list[list[str]]:
    mods = _modules()
    known = set(mods)
    graph = {n: imports_of(n, p, known) for n, p in mods.items()}
    # a package's __init__ importing its own submodules is how a package exposes them, not a circle;
    # a submodule importing its parent package's __init__ is, so edges into a package stay.
    for n in graph:
        graph[n] = {m for m in graph[n] if not m.startswith(n + ".")}
    out: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                out.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return out


def test_no_import_circles():
    assert cycles() == []


def test_no_module_over_the_limit():
    long = {n: len(p.read_text(encoding="utf-8").splitlines()) for n, p in _modules().items()}
    assert {n: c for n, c in long.items() if c > MAX_LINES} == {}


def test_every_backend_has_the_same_rooms():
    for backend in ("torch", "keras", "jax"):
        here = PACKAGE / "backends" / backend
        missing = [room for room in ROOMS if not (here / f"{room}.py").exists()]
        assert missing == [], f"backends/{backend} lacks {missing}"


if __name__ == "__main__":
    for c in cycles():
        print(" -> ".join(c))
    for n, p in sorted(_modules().items()):
        c = len(p.read_text(encoding="utf-8").splitlines())
        if c > MAX_LINES:
            print(f"{n}: {c} lines")
