"""Reading and writing policy files: TOML, YAML, JSON and ``pyproject.toml``.

Reading is three steps: parse the text (remembering the line of every key, so an error can
point at it), resolve ``extends`` (a preset name or a file relative to the one that names it;
tables merge key by key, everything else is replaced), then validate the merged document
with the checks of :mod:`ampbridge.core.policy`, collecting every problem before raising.

Writing is canonical: a fixed key order, canonical dtype names, every setting spelled out,
so ``load(dumps(p)) == p`` and ``dumps(load(dumps(p))) == dumps(p)``.

Example:
    >>> import ampbridge
    >>> p = ampbridge.loads('compute_dtype = "bf16"')
    >>> ampbridge.loads(ampbridge.dumps(p, format="json"), format="json") == p
    True
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailableError, PolicyError, Problem
from .fields import Collector, KeyPath, key_text
from .matching import did_you_mean
from .plan import gc_paused
from .policy import PRESETS, Policy, build, check_document_shape, merge_fp8, policy_to_dict

__all__ = ["load", "loads", "dumps", "dump", "preset", "PRESETS", "load_with_origins"]

FORMATS = ("toml", "yaml", "json")
_SUFFIXES = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}

# --- parsing with line numbers -----------------------------------------------------------------

Locate = Callable[[KeyPath], "int | None"]


def _nearest(lines: dict[KeyPath, int]) -> Locate:
    def locate(path: KeyPath) -> int | None:
        path = tuple(path)
        while path:
            if path in lines:
                return lines[path]
            path = path[:-1]
        return None

    return locate


_TOML_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_TOML_KEY = re.compile(r"^\s*([A-Za-z0-9_\-.\"' ]+?)\s*=")


def _toml_lines(text: str, root: tuple[str, ...]) -> dict[KeyPath, int]:
    """Map key paths to line numbers by scanning TOML headers and ``key =`` lines.

    tomllib gives values but no positions; this scan is only for error messages, so a
    construct it does not follow (a multi-line inline table) costs a line number, never a value.
    """
    lines: dict[KeyPath, int] = {}
    counters: dict[tuple[str, ...], int] = {}
    table: tuple[Any, ...] = ()
    in_multiline = False
    for number, line in enumerate(text.splitlines(), start=1):
        if in_multiline:
            if line.count('"""') % 2 == 1 or line.count("'''") % 2 == 1:
                in_multiline = False
            continue
        m = _TOML_HEADER.match(line)
        if m:
            names = tuple(n.strip().strip('"\'') for n in m.group(2).split("."))
            if names[: len(root)] != root:
                table = ("<outside>",)
                continue
            names = names[len(root):]
            resolved: list[Any] = []
            for depth, name in enumerate(names):
                resolved.append(name)
                prefix = tuple(names[: depth + 1])
                is_last = depth == len(names) - 1
                if is_last and m.group(1) == "[[":
                    counters[prefix] = counters.get(prefix, -1) + 1
                    resolved.append(counters[prefix])
                elif prefix in counters:  # [phase.loss_scale] refers to the latest [[phase]]
                    resolved.append(counters[prefix])
            table = tuple(resolved)
            lines.setdefault(table, number)
            continue
        m = _TOML_KEY.match(line)
        if m and table != ("<outside>",):
            key = tuple(k.strip().strip('"\'') for k in m.group(1).split("."))
            lines.setdefault(table + key, number)
            rest = line[m.end():]
            if rest.count('"""') % 2 == 1 or rest.count("'''") % 2 == 1:
                in_multiline = True
    return lines


def _yaml_module(doing: str = "reading") -> Any:
    try:
        import yaml
    except ImportError:
        raise BackendUnavailableError(
            f"{doing} a YAML policy needs PyYAML. Install with: pip install 'ampbridge[yaml]'"
        ) from None
    return yaml


def _yaml_lines(node: Any, path: KeyPath, lines: dict[KeyPath, int], dupes: list[tuple[KeyPath, int]]) -> None:
    yaml = _yaml_module()
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            child = path + (key,)
            if key in seen:
                dupes.append((child, key_node.start_mark.line + 1))
            seen.add(key)
            lines.setdefault(child, key_node.start_mark.line + 1)
            _yaml_lines(value_node, child, lines, dupes)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.setdefault(path + (i,), item.start_mark.line + 1)
            _yaml_lines(item, path + (i,), lines, dupes)


def _json_lines(text: str) -> dict[KeyPath, int]:
    """Line of every key in a JSON document (the document is known to parse)."""
    lines: dict[KeyPath, int] = {}
    decoder = json.JSONDecoder()
    pos = 0

    # the offsets of every newline, found once: a position's line is a binary search (linear overall)
    newlines = [m.start() for m in re.finditer("\n", text)]

    def line_at(i: int) -> int:
        return bisect.bisect_left(newlines, i) + 1

    def skip_ws(i: int) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def value(i: int, path: KeyPath) -> int:
        i = skip_ws(i)
        ch = text[i]
        if ch == "{":
            i = skip_ws(i + 1)
            if text[i] == "}":
                return i + 1
            while True:
                i = skip_ws(i)
                key, end = json.decoder.scanstring(text, i + 1)
                lines.setdefault(path + (key,), line_at(i))
                i = skip_ws(end)
                i = value(i + 1, path + (key,))  # past the ':'
                i = skip_ws(i)
                if text[i] == "}":
                    return i + 1
                i += 1  # ','
        if ch == "[":
            i = skip_ws(i + 1)
            if text[i] == "]":
                return i + 1
            index = 0
            while True:
                i = skip_ws(i)
                lines.setdefault(path + (index,), line_at(i))
                i = skip_ws(value(i, path + (index,)))
                if text[i] == "]":
                    return i + 1
                i += 1
                index += 1
        _, end = decoder.raw_decode(text, i)
        return end

    try:
        value(pos, ())
    except (ValueError, IndexError):  # positions are a nicety; never fail a load over them
        pass
    return lines


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


class _DuplicateKey(Exception):
    pass


#: bounds on a document, far above any policy (which nests 4 deep and holds a few hundred values):
#: a hostile one is refused in one line, before it costs memory or Python's recursion limit
MAX_DEPTH = 32
MAX_VALUES = 100_000


def _bounded(where: str, what: str) -> PolicyError:
    return PolicyError([Problem(f"{what}; a policy document nests at most {MAX_DEPTH} levels and holds at "
                                f"most {MAX_VALUES} values", file=where)])


def _check_bounds(data: Any, where: str) -> None:
    """Refuse a parsed document nested deeper than MAX_DEPTH or holding more than MAX_VALUES values."""
    stack, count = [(data, 0)], 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise _bounded(where, f"the document holds more than {MAX_VALUES} values")
        if isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise _bounded(where, f"the document nests deeper than {MAX_DEPTH} levels")
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)


def _yaml_expanded(node: Any, depth: int, memo: dict[int, int], where: str) -> int:
    """How many values a YAML node stands for once its aliases are expanded (each shared node is
    counted once per use, computed once): an alias bomb is refused before anything walks it."""
    if id(node) in memo:
        return memo[id(node)]
    if depth >= MAX_DEPTH:
        raise _bounded(where, f"the document nests deeper than {MAX_DEPTH} levels")
    children = node.value if isinstance(node.value, list) else []
    total = 1
    for child in children:
        for part in (child if isinstance(child, tuple) else (child,)):
            total += _yaml_expanded(part, depth + 1, memo, where)
            if total > MAX_VALUES:
                raise _bounded(where, f"the document expands to more than {MAX_VALUES} values through YAML "
                                      "aliases (&anchor / *alias)")
    memo[id(node)] = total
    return total


def _parse(text: str, fmt: str, source: str | None, root: tuple[str, ...] = ()) -> tuple[Any, Locate]:
    """Parse a document; return its data and a key-path -> line function."""
    where = source or "<string>"
    try:
        data, locate = _parse_unbounded(text, fmt, where, root)
    except RecursionError:  # a parser's own recursion (JSON, TOML or YAML nested thousands deep)
        raise _bounded(where, "the document nests too deep to read") from None
    _check_bounds(data, where)
    return data, locate


def _parse_unbounded(text: str, fmt: str, where: str, root: tuple[str, ...]) -> tuple[Any, Locate]:
    if fmt == "toml":
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            m = re.search(r"at line (\d+)", str(e))
            raise PolicyError([Problem(f"not valid TOML: {e}", file=where,
                                       line=int(m.group(1)) if m else None)]) from None
        for name in root:
            if not isinstance(data, dict) or name not in data:
                raise PolicyError([Problem(f"no [{'.'.join(root)}] table in this file", file=where,
                                           hint="put the policy under [tool.ampbridge]")])
            data = data[name]
        return data, _nearest(_toml_lines(text, root))
    if fmt == "json":
        try:
            data = json.loads(text, object_pairs_hook=_reject_duplicates)
        except _DuplicateKey as e:
            raise PolicyError([Problem(f"duplicate key {e.args[0]!r}", file=where)]) from None
        except json.JSONDecodeError as e:
            raise PolicyError([Problem(f"not valid JSON: {e.msg}", file=where, line=e.lineno)]) from None
        return data, _nearest(_json_lines(text))
    if fmt == "yaml":
        yaml = _yaml_module()
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
            if node is not None:
                _yaml_expanded(node, 0, {}, where)
            data = yaml.load(text, Loader=yaml.SafeLoader)  # safe: never constructs objects
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
            problem = getattr(e, "problem", None) or str(e)
            hint = None
            if "python/" in str(e):
                hint = "ampbridge reads YAML with a safe loader: Python object tags are refused, never run"
            raise PolicyError([Problem(f"not valid YAML: {problem}", file=where,
                                       line=mark.line + 1 if mark else None, hint=hint)]) from None
        lines: dict[KeyPath, int] = {}
        dupes: list[tuple[KeyPath, int]] = []
        if node is not None:
            _yaml_lines(node, (), lines, dupes)
        if dupes:
            raise PolicyError([Problem(f"duplicate key {p[-1]!r}", key=key_text(p), file=where, line=n)
                               for p, n in dupes])
        return ({} if data is None else data), _nearest(lines)
    raise PolicyError([Problem("unknown policy format", key="format", value=fmt,
                               accepted=", ".join(FORMATS))])


# --- extends and merging ----------------------------------------------------------------------

@dataclass
class _Doc:
    """One document of an ``extends`` chain: where it came from and how to locate its keys."""

    source: str
    locate: Locate


@dataclass
class _Merged:
    data: dict[str, Any] = field(default_factory=dict)
    # which document each top-level key (and each loss_scale key) came from
    origin: dict[KeyPath, _Doc] = field(default_factory=dict)

    def where(self, path: KeyPath) -> tuple[str | None, int | None]:
        head = tuple(path[:2]) if path and path[0] in ("loss_scale", "kinds", "fp8") else tuple(path[:1])
        doc = self.origin.get(head) or self.origin.get(tuple(path[:1]))
        if doc is None:
            return None, None
        return doc.source, doc.locate(path)


def _read_file(path: Path) -> tuple[str, str, tuple[str, ...]]:
    """Text, format and root table of a policy file (``pyproject.toml``: ``tool.ampbridge``)."""
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise PolicyError([Problem("cannot tell the policy format from the file name", file=str(path),
                                   accepted="a name ending in .toml, .yaml, .yml or .json, or pyproject.toml")])
    text = read_text(path)
    root = ("tool", "ampbridge") if path.name == "pyproject.toml" else ()
    return text, fmt, root


def read_text(path: Path) -> str:
    """A settings file's text (a byte-order mark dropped), or a PolicyError naming the file and why
    it cannot be read: missing, a directory, not UTF-8, or the system's reason."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise PolicyError([Problem("no such file", file=str(path))]) from None
    except IsADirectoryError:
        raise PolicyError([Problem("a directory, not a file", file=str(path))]) from None
    except UnicodeDecodeError as e:
        raise PolicyError([Problem(f"not UTF-8 text (byte {e.start}); is it a binary file?", file=str(path))]) from None
    except OSError as e:
        raise PolicyError([Problem(f"cannot read the file: {e.strerror or e}", file=str(path))]) from None


def _merge_into(merged: _Merged, data: Mapping[str, Any], doc: _Doc) -> None:
    for key, value in data.items():
        if key in ("extends",):
            continue
        # [loss_scale] and [kinds] merge key by key (a [kinds] list replaces the parent's list of that kind)
        if key == "fp8" and isinstance(value, dict) and isinstance(merged.data.get(key), dict):
            merged.data[key] = merge_fp8(merged.data[key], value)
            for sub in value:
                merged.origin[(key, sub)] = doc
            merged.origin.setdefault((key,), doc)
            continue
        if key in ("loss_scale", "kinds") and isinstance(value, dict) and isinstance(merged.data.get(key), dict):
            table = dict(merged.data[key])
            for sub, v in value.items():
                table[sub] = v
                merged.origin[(key, sub)] = doc
            merged.data[key] = table
            merged.origin.setdefault((key,), doc)
            continue
        merged.data[key] = value
        merged.origin[(key,)] = doc
        if key in ("loss_scale", "kinds", "fp8") and isinstance(value, dict):
            for sub in value:
                merged.origin[(key, sub)] = doc


# --- building the Policy ---------------------------------------------------------------------

def _locating(locate: Locate, source: str) -> Callable[[KeyPath], tuple[str | None, int | None]]:
    return lambda path: (source, locate(path))


# --- public API ----------------------------------------------------------------------------------

def load(path: str | os.PathLike[str]) -> Policy:
    """Load a policy file (``.toml``, ``.yaml``/``.yml``, ``.json``, or ``pyproject.toml``).

    Raises :class:`PolicyError` naming the file, line, key, value and what is accepted.

    Example:
        >>> import ampbridge, tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "amp.toml").write_text('extends = "mixed_bfloat16"')
        >>> ampbridge.load(d / "amp.toml").compute_dtype
        'bfloat16'
    """
    return load_with_origins(path)[0]


def load_with_origins(path: str | os.PathLike[str]) -> tuple[Policy, dict[str, str]]:
    """Load a policy and say where each set key came from (``{"loss_scale.mode": "base.toml"}``).

    Keys absent from the result were filled with defaults (``ampbridge show`` marks them).
    """
    p = Path(path)
    text, fmt, root = _read_file(p)
    return _loads_with_origins(text, fmt, str(p), p.parent, root, chain=(str(p.resolve()),))


def _loads_with_origins(text: str, fmt: str, source: str | None, base_dir: Path,
                        root: tuple[str, ...] = (), chain: tuple[str, ...] = ()) -> tuple[Policy, dict[str, str]]:
    with gc_paused():  # a large policy allocates millions of objects; collections would re-walk them all
        return _loads_located(text, fmt, source, base_dir, root, chain)


def _loads_located(text: str, fmt: str, source: str | None, base_dir: Path, root: tuple[str, ...],
                   chain: tuple[str, ...]) -> tuple[Policy, dict[str, str]]:
    where = source or "<string>"
    data, locate = _parse(text.removeprefix("\ufeff"), fmt, where, root)
    if data == {} or data is None:
        table = f" [{'.'.join(root)}] table" if root else ""
        raise PolicyError([Problem(f"the policy{table} is empty: it sets nothing", file=where,
                                   hint='write version = 1 for an all-float32 policy, or extends = "mixed_float16"')])
    doc = _Doc(where, locate)
    # shape problems are reported while resolving; give the collector this document's lines
    policy, merged = _load_document_located(data, doc, base_dir, chain)
    origins = {key_text(k): d.source for k, d in merged.origin.items()}
    return policy, origins


def _load_document_located(data: Any, doc: _Doc, base_dir: Path, chain: tuple[str, ...]) -> tuple[Policy, _Merged]:
    out = Collector(_locating(doc.locate, doc.source))
    merged = _resolve_located(data, doc, base_dir, chain, out)
    out._locate = merged.where  # value problems point at the file the key came from
    policy = build(merged.data, doc.source if doc.source != "<string>" else None, out)
    if policy is None or out.problems:
        raise PolicyError(sorted(out.problems, key=lambda p: (p.file or "", p.line or 0)))
    return policy, merged


def _resolve_located(data: Any, doc: _Doc, base_dir: Path, chain: tuple[str, ...], out: Collector) -> _Merged:
    # shape checks of each document must point at that document's lines
    saved = out._locate
    out._locate = _locating(doc.locate, doc.source)
    try:
        data = check_document_shape(data, out)
    finally:
        out._locate = saved
    merged = _Merged()
    parent = data.get("extends") if isinstance(data, dict) else None
    if parent is not None:
        merged = _resolve_parent(parent, doc, base_dir, chain, out)
    _merge_into(merged, data, doc)
    return merged


def _resolve_parent(parent: Any, doc: _Doc, base_dir: Path, chain: tuple[str, ...], out: Collector) -> _Merged:
    merged = _Merged()
    here = _locating(doc.locate, doc.source)
    saved = out._locate
    out._locate = here
    try:
        if not isinstance(parent, str) or not parent.strip():
            out.add(("extends",), "must be a preset name or a relative file path", value=parent,
                    accepted="a preset (" + ", ".join(PRESETS) + ") or a path such as 'base.toml'")
            return merged
        if parent in PRESETS:
            _merge_into(merged, PRESETS[parent], _Doc(f"preset:{parent}", lambda p: None))
            return merged
        try:
            path = (base_dir / parent).resolve()
            exists = path.exists()
        except (OSError, ValueError) as e:  # NUL bytes, lone surrogates, names too long
            out.add(("extends",), f"not a usable file path ({type(e).__name__}: {e})", value=parent,
                    accepted="a preset (" + ", ".join(PRESETS) + ") or a relative file path")
            return merged
        if str(path) in chain:
            cycle = " -> ".join([Path(c).name for c in chain] + [path.name])
            out.add(("extends",), f"extends makes a cycle: {cycle}", value=parent)
            return merged
        if not exists:
            hint = did_you_mean(parent, tuple(PRESETS))
            out.add(("extends",), "neither a preset nor an existing file" + (f"; {hint}" if hint else ""),
                    value=parent, accepted="a preset (" + ", ".join(PRESETS) + ") or a path relative to "
                    + (doc.source if doc.source != "<string>" else "the current directory"))
            return merged
    finally:
        out._locate = saved
    try:
        text, fmt, root = _read_file(path)
        parent_data, locate = _parse(text, fmt, str(path), root)
    except PolicyError as e:
        out.problems.extend(e.problems)
        return merged
    return _resolve_located(parent_data, _Doc(str(path), locate), path.parent, chain + (str(path),), out)


def loads(text: str, format: str = "toml", *, source: str | None = None,
          base_dir: str | os.PathLike[str] | None = None) -> Policy:
    """Load a policy from text. ``extends`` paths are relative to ``base_dir`` (default: cwd).

    Example:
        >>> import ampbridge
        >>> ampbridge.loads('{"compute_dtype": "fp16"}', format="json").compute_dtype
        'float16'
    """
    if format not in FORMATS:
        raise PolicyError([Problem("unknown policy format", key="format", value=format,
                                   accepted=", ".join(FORMATS))])
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    return _loads_with_origins(text, format, source, base)[0]


def policy_from_dict(data: Mapping[str, Any]) -> Policy:
    """Build a Policy from plain data (the shape ``to_dict`` and the JSON file use)."""
    return Policy.from_dict(data)


def preset(name: str) -> Policy:
    """A built-in policy: ``float32``, ``mixed_float16``, ``mixed_bfloat16``, ``bfloat16``, ``float16``.

    Example:
        >>> import ampbridge
        >>> ampbridge.preset("mixed_float16").resolved_loss_scale.mode
        'dynamic'
    """
    if name not in PRESETS:
        hint = did_you_mean(str(name), tuple(PRESETS))
        raise PolicyError([Problem("unknown preset", key="preset", value=name, accepted=", ".join(PRESETS),
                                   hint=hint)])
    doc = _Doc(f"preset:{name}", lambda p: None)
    return _load_document_located(dict(PRESETS[name]), doc, Path.cwd(), ())[0]



def as_policy(policy: "Policy | str | os.PathLike[str]") -> Policy:
    """A Policy from a Policy, a preset name or a policy file path: the one resolution every
    entry point uses (a preset name wins over a file of the same name in the working directory).

    Example:
        >>> as_policy("mixed_bfloat16").compute_dtype
        'bfloat16'
    """
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, os.PathLike)):
        return preset(str(policy)) if str(policy) in PRESETS else load(policy)
    raise TypeError(f"policy must be an ampbridge.Policy, a preset name ({', '.join(PRESETS)}) or a "
                    f"policy file path; received {policy!r} (of type {type(policy).__name__})")

# --- writing -----------------------------------------------------------------------------------

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("non-finite numbers cannot be written")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _toml_table(d: Mapping[str, Any], prefix: str, lines: list[str], notes: Mapping[str, str], path: str) -> None:
    for k, v in d.items():
        if isinstance(v, dict) or _is_table_list(v):
            continue
        note = notes.get(f"{path}{k}")
        lines.append(f"{k} = {_toml_value(v)}" + (f"  # {note}" if note else ""))
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            lines.append("")
            lines.append(f"[{name}]")
            _toml_table(v, name + ".", lines, notes, f"{path}{k}.")
        elif _is_table_list(v):
            for i, item in enumerate(v):
                lines.append("")
                lines.append(f"[[{name}]]")
                _toml_table(item, name + ".", lines, notes, f"{path}{k}[{i}].")


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        text = repr(v)
        if "e" in text and "." not in text.split("e")[0]:
            mantissa, exp = text.split("e")
            text = f"{mantissa}.0e{exp if exp[0] in '+-' else '+' + exp}"
        return text
    if isinstance(v, int):
        return repr(v)
    return json.dumps(v, ensure_ascii=False)  # a double-quoted YAML scalar


def _yaml_block(d: Mapping[str, Any], indent: int, lines: list[str], notes: Mapping[str, str], path: str) -> None:
    pad = " " * indent
    for k, v in d.items():
        note = notes.get(f"{path}{k}")
        tail = f"  # {note}" if note else ""
        if isinstance(v, dict):
            lines.append(f"{pad}{k}:" + ("" if v else " {}") + tail)
            _yaml_block(v, indent + 2, lines, notes, f"{path}{k}.")
        elif isinstance(v, list):
            if not v:
                lines.append(f"{pad}{k}: []{tail}")
            elif all(isinstance(x, dict) for x in v):
                lines.append(f"{pad}{k}:{tail}")
                for i, item in enumerate(v):
                    sub: list[str] = []
                    _yaml_block(item, indent + 4, sub, notes, f"{path}{k}[{i}].")
                    if sub:
                        sub[0] = f"{pad}  - " + sub[0].lstrip()
                    lines.extend(sub or [f"{pad}  - {{}}"])
            else:
                lines.append(f"{pad}{k}: [" + ", ".join(_yaml_scalar(x) for x in v) + "]" + tail)
        else:
            lines.append(f"{pad}{k}: {_yaml_scalar(v)}{tail}")


def render(data: Mapping[str, Any], format: str = "toml", notes: Mapping[str, str] | None = None) -> str:
    """Render canonical policy data; ``notes`` maps dotted keys to end-of-line comments."""
    notes = notes or {}
    if format == "json":
        return json.dumps(data, indent=2) + "\n"
    lines: list[str] = []
    if format == "toml":
        _toml_table(data, "", lines, notes, "")
    elif format == "yaml":
        _yaml_block(data, 0, lines, notes, "")
    else:
        raise PolicyError([Problem("unknown policy format", key="format", value=format,
                                   accepted=", ".join(FORMATS))])
    return "\n".join(lines) + "\n"


def dumps(policy: Policy, format: str = "toml") -> str:
    """Write a policy in canonical form; ``load(dumps(p)) == p``.

    Example:
        >>> import ampbridge
        >>> print(ampbridge.dumps(ampbridge.preset("float32")).splitlines()[1])
        compute_dtype = "float32"
    """
    return render(policy_to_dict(policy), format)


def dump(policy: Policy, path: str | os.PathLike[str], format: str | None = None) -> None:
    """Write a policy to a file; the format follows the suffix unless given."""
    p = Path(path)
    fmt = format or _SUFFIXES.get(p.suffix.lower())
    if fmt is None:
        raise PolicyError([Problem("cannot tell the format from the file name", file=str(p),
                                   accepted="a name ending in .toml, .yaml, .yml or .json, or format=")])
    p.write_text(dumps(policy, fmt), encoding="utf-8")
