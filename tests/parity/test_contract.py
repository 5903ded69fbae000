"""docs/backends.md's contract table against the code: every backend's verbs with the signature
(names, kinds, defaults, return annotation) and the room (``__module__``) the table gives them."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from ampbridge._testing import require

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "backends.md"
PACKAGES = ROOT / "ampbridge" / "backends"
FIXED_COLUMNS = ("verb", "signature", "returns", "room")
ABSENT = "—"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def contract_table(text: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The backends (the columns after the fixed ones) and, per verb, its row by column name."""
    lines = text.split("## The table", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| verb |"))
    header = _cells(lines[start])
    assert tuple(header[:4]) == FIXED_COLUMNS, header
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        assert len(cells) == len(header), f"{DOC.name}: a row with {len(cells)} cells, {len(header)} columns: {line}"
        rows[cells[0]] = dict(zip(header, cells))
    return header[4:], rows


def parse_signature(cell: str) -> tuple[list[tuple[str, str, object]], str | None]:
    """``(a, *b, c=1, **d) -> R`` as [(name, kind, default)] and R (None when the cell gives none)."""
    code = re.fullmatch(r"`(.*)`", cell)
    assert code, f"a signature cell is one `...` span: {cell!r}"
    tree = ast.parse(f"def f{code.group(1)}: pass").body[0]
    a = tree.args
    params = [(p.arg, "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty) for p in a.args]
    for p, d in zip(reversed(a.args), reversed(a.defaults)):
        i = [n for n, *_ in params].index(p.arg)
        params[i] = (p.arg, "POSITIONAL_OR_KEYWORD", ast.literal_eval(d))
    if a.vararg:
        params.append((a.vararg.arg, "VAR_POSITIONAL", inspect.Parameter.empty))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append((p.arg, "KEYWORD_ONLY", inspect.Parameter.empty if d is None else ast.literal_eval(d)))
    if a.kwarg:
        params.append((a.kwarg.arg, "VAR_KEYWORD", inspect.Parameter.empty))
    return params, None if tree.returns is None else ast.unparse(tree.returns)


def actual_signature(obj: object) -> tuple[list[tuple[str, str, object]], str | None]:
    sig = inspect.signature(obj)
    params = [(p.name, p.kind.name, p.default) for p in sig.parameters.values()]
    ret = sig.return_annotation
    return params, None if ret is inspect.Signature.empty else str(ret).strip("'\"")


def backend_packages() -> list[str]:
    return sorted(p.name for p in PACKAGES.iterdir() if (p / "__init__.py").is_file())


TEXT = DOC.read_text(encoding="utf-8")
BACKENDS, ROWS = contract_table(TEXT)
VERBS = list(ROWS)


def test_every_backend_package_has_a_column_and_every_verb_a_row():
    assert sorted(BACKENDS) == backend_packages()
    assert VERBS == ["plan", "trace", "apply", "optimizer", "Monitor", "layers", "owns", "register_kind", "tune"]


#: verbs that take a short training run's inputs as the framework's own loop does (torch batches and a
#: loss function, Keras fit's data and loss, Flax variables, batches and a loss function)
TRAINING_INPUTS_POSITIONAL = {"tune"}


@pytest.mark.parametrize("verb", VERBS)
def test_each_cell_extends_the_shared_signature(verb):
    """The shared positional parameters first, in order; shared keyword parameters with their default;
    a backend's extras keyword-only (``*example_inputs`` and ``**kwargs`` allowed)."""
    shared, _ = parse_signature(ROWS[verb]["signature"])
    for backend in BACKENDS:
        cell = ROWS[verb][backend]
        if cell == ABSENT:
            continue
        params, _ = parse_signature(cell)
        positional = [p for p in shared if p[1] != "KEYWORD_ONLY"]
        assert params[:len(positional)] == positional, f"{backend}.{verb}: {cell} does not start with {positional}"
        for p in shared:
            assert p in params, f"{backend}.{verb}: {cell} lacks the shared {p[0]}={p[2]!r}"
        for name, kind, _ in params:
            if any(name == s[0] for s in shared):
                continue
            if verb in TRAINING_INPUTS_POSITIONAL and kind == "POSITIONAL_OR_KEYWORD":
                continue  # what the framework's own training call takes, in its order (docs/backends.md)
            assert kind in ("KEYWORD_ONLY", "VAR_KEYWORD") or (kind, name) == ("VAR_POSITIONAL", "example_inputs"), (
                f"{backend}.{verb}: the extra {name} must be keyword-only")


def _module(backend: str):
    require({"torch": "torch", "keras": "keras", "tf_keras": "tf_keras", "jax": "flax"}.get(backend, backend))
    return importlib.import_module(f"ampbridge.backends.{backend}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_code_follows_the_table(backend):
    module = _module(backend)
    for verb in VERBS:
        row, cell = ROWS[verb], ROWS[verb][backend]
        obj = getattr(module, verb, None)
        if cell == ABSENT:
            assert not callable(obj) or inspect.ismodule(obj), f"{backend}.{verb} exists; the table says —"
            continue
        assert obj is not None and not inspect.ismodule(obj), f"{backend} has no verb {verb}"
        assert verb in module.__all__, f"{backend}.{verb} is not in __all__"
        assert obj.__module__ == f"ampbridge.backends.{backend}.{row['room']}", (
            f"{backend}.{verb} is defined in {obj.__module__}; the table's room is {row['room']}")
        want, want_return = parse_signature(cell)
        got, got_return = actual_signature(obj)
        assert got == want, f"{backend}.{verb}: the code has {got}, the table {cell}"
        if want_return is not None:
            assert got_return == want_return, f"{backend}.{verb} returns {got_return}; the table says {want_return}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_public_surface_is_small(backend):
    module = _module(backend)
    assert len(module.__all__) <= 25, (backend, len(module.__all__))
    assert "LossScaleState" not in module.__all__  # one LossScaleState: the core's


def test_the_parser_reads_what_the_table_means():
    params, ret = parse_signature("`(model, policy, *example_inputs, warn=True, device_type=None, **kw) -> Plan`")
    assert params == [("model", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
                      ("policy", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
                      ("example_inputs", "VAR_POSITIONAL", inspect.Parameter.empty),
                      ("warn", "KEYWORD_ONLY", True), ("device_type", "KEYWORD_ONLY", None),
                      ("kw", "VAR_KEYWORD", inspect.Parameter.empty)] and ret == "Plan"
