"""Rooms talk through explicit interfaces: held by reading the source (ast), no framework imported.

Two lines held: (1) the places that read another room's private attributes read its public
interface now (Keras fit sampling -> ``Monitor.sampling_hooks``; Keras apply -> its observers
(``observe_apply``), not the monitor's ``_refresh``; the Keras monitor -> the optimizer's ``monitor_*``
interface; the JAX monitor -> ``Applied``'s ``resolver``/``known_paths``/``rows_for_paths``, sampling's
``Window`` and an NNX key's fields; JAX's model walk -> ``nnx.nnx_layers``; the demo and
torch's trace -> ``TorchAmp.realisation``);
(2) per backend, the number of private names a module imports from another ampbridge module
(unique (importer, module, name)) stays at or under what it is now (``python tests/core/test_rooms.py``
prints the counts and the largest clusters).
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ampbridge"

#: file -> the names whose private attributes it must not read (the owner's interface is public)
NO_PRIVATE_READS = {
    "backends/keras/sampling.py": ("monitor", "self.monitor"),
    "backends/keras/apply.py": ("monitor", "observer"),
    "backends/keras/monitor.py": ("optimizer", "self.optimizer"),
    "backends/jax/monitor.py": ("model", "window", "key"),
    "backends/jax/layers.py": ("room_above(__package__, 'nnx')",),
    "backends/jax/schedule.py": ("self.amp",),
    "backends/torch/trace.py": ("amp",),
    "cli/demo/runners.py": ("amp",),
}

#: backend -> most cross-room private imports allowed (before the split: torch 29, jax 103, keras 53, tf_keras 17;
#: before the Keras and JAX monitors' interfaces: torch 14, jax 31, keras 38, tf_keras 17)
CEILING = {"torch": 0, "jax": 0, "keras": 0, "tf_keras": 0}


def _private_reads(relative: str, bases: tuple[str, ...]) -> list[str]:
    tree = ast.parse((PACKAGE / relative).read_text())
    return [f"{relative}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and ast.unparse(node.value) in bases]


def cross_room_private_imports() -> dict[str, set[tuple[str, str, str]]]:
    """backend -> {(importing module, imported module, private name)} across ampbridge modules."""
    found: dict[str, set[tuple[str, str, str]]] = collections.defaultdict(set)
    for path in sorted((PACKAGE / "backends").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts if parts[-1] == "__init__" else parts[:-1]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) < 3:
            continue
        me = ".".join(parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = [p for p in package if p != "__init__"][:len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if (source.startswith("ampbridge") and source != me and alias.name.startswith("_")
                        and not alias.name.startswith("__")):
                    found[parts[2]].add((me, source, alias.name))
    return found


def test_rooms_read_each_others_public_interfaces():
    reads = [line for relative, bases in NO_PRIVATE_READS.items() for line in _private_reads(relative, bases)]
    assert not reads, "private attributes read across rooms:\n" + "\n".join(reads)


def test_cross_room_private_imports_stay_under_the_ceiling():
    counts = {backend: len(pairs) for backend, pairs in cross_room_private_imports().items()}
    assert set(counts) <= set(CEILING), counts
    over = {b: (n, CEILING[b]) for b, n in counts.items() if n > CEILING[b]}
    assert not over, f"cross-room private imports over the ceiling (found, allowed): {over}"


if __name__ == "__main__":
    for backend, pairs in sorted(cross_room_private_imports().items()):
        print(backend, len(pairs))
        if "-v" in sys.argv:
            clusters = collections.Counter((a.rsplit(".", 1)[-1], b.rsplit(".", 1)[-1]) for a, b, _ in pairs)
            for (importer, source), n in clusters.most_common(8):
                print(f"  {n:3d} {importer} <- {source}")
