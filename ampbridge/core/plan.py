"""The Plan: which layer runs in which dtype, and which rule decided it.

A backend describes its model as neutral :class:`Layer` descriptors (path, kind, class name,
own parameter count); :func:`build_plan` matches them against the policy's rules and returns
one :class:`PlanRow` per layer. Resolution, per layer:

1. the *last* rule (``keep_float32`` entries first, then ``[[override]]`` tables, in file
   order) that matches the layer itself decides it;
2. otherwise, where the model's author fixed the layer's dtypes (``Layer.fixed``: Keras's
   ``Activation("softmax", dtype="float32")``, a Flax module's hard-coded dtype), they stay
   (the row's rule: ``set by the model``);
3. otherwise the layer inherits the decision of its nearest ancestor that a rule matched, or
   whose dtypes the author fixed (pinning ``decoder`` pins everything inside it, as torch's
   autocast-disabled region would);
4. otherwise the policy's own dtypes apply (``default``).

A rule leaves out a dtype to take the policy's: ``compute_dtype`` and ``param_dtype`` default
to the policy's, ``output_dtype`` to the row's compute dtype (a layer emits what it computes).

Example:
    >>> from ampbridge import Layer, build_plan, Policy
    >>> plan = build_plan([Layer("encoder", None, "Block"), Layer("encoder.norm", "norm", "LayerNorm")],
    ...                   Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",)))
    >>> plan["encoder.norm"].compute_dtype, plan["encoder.norm"].rule
    ('float32', 'keep_float32[0]')
"""

from __future__ import annotations

import contextlib
import gc
import json
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import BroadRuleWarning, IdleRuleWarning, UnmatchedRuleWarning, outside_stacklevel
from .kinds import NOT_INFERRED, KindTable, looks_like, settle_kinds
from .matching import KINDS, Pattern, compile_pattern
from .policy import Policy
from .plan_table import render as render_plan

__all__ = ["Layer", "PlanRow", "Plan", "RowResolver", "build_plan", "layers_from_data"]


@dataclass(frozen=True)
class Layer:
    """A framework-neutral description of one layer.

    ``path`` joins the layer's names with ``.``; ``kind`` is one of :data:`ampbridge.KINDS` or
    None; ``param_count`` counts the parameters the layer owns itself (not its children's);
    ``kind_source`` says how the kind was decided (``"framework class"``, ``"class name"``,
    ``"base class LlamaRMSNorm"``, ``"structure: ..."``, ``"registered"``, ``"[kinds] table"``; see
    :mod:`ampbridge.core.kinds`); ``fixed`` is the (compute, param) dtype pair the model's author
    fixed for this layer in code, or None: kept unless a rule matches the layer itself.
    """

    path: str
    kind: str | None = None
    class_name: str = ""
    param_count: int = 0
    kind_source: str | None = None
    fixed: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in KINDS:
            raise ValueError(f"layer {self.path!r}: unknown kind {self.kind!r}; accepted: {', '.join(KINDS)} or None")


@dataclass(frozen=True)
class PlanRow:
    """One layer of the Plan. ``rule`` is ``"default"``, ``"keep_float32[i]"``, ``"override[i]"`` or
    ``"set by the model"`` (dtypes the model's author fixed in code)."""

    path: str
    kind: str | None
    class_name: str
    param_count: int
    compute_dtype: str
    param_dtype: str
    output_dtype: str
    rule: str = "default"
    pattern: str | None = None  # the pattern of the deciding rule that matched
    inherited_from: str | None = None  # the ancestor whose rule this row follows
    note: str | None = None  # where the framework's own machinery changes the row
    kind_source: str | None = None  # how the kind was decided (a Plan JSON without it still loads)
    #: ops of the layer that ran in another dtype than its compute dtype, as ``"op dtype"`` (a trace
    #: saw them: MoE experts' ``_grouped_mm`` that CPU autocast does not cast); shown as a footnote
    other_ops: tuple[str, ...] = ()
    #: the framework itself computes inside this layer in float32 whatever its compute dtype (Keras's
    #: and Flax's norm statistics, a float32 softmax): a trace of the layer's call cannot see those ops
    float32_inside: bool = False
    #: the ``[fp8]`` table's decision: the layer's matmuls take float8 inputs in ``fp8_forward``
    #: (activations, weights) and ``fp8_backward`` (output gradients), scaled by ``fp8_scaling``;
    #: ``fp8_by`` names the machinery that realises it (the backend fills it in). None: no float8.
    fp8_forward: str | None = None
    fp8_backward: str | None = None
    fp8_scaling: str | None = None
    fp8_by: str | None = None

    @property
    def fp8(self) -> bool:
        """Whether the layer's matmuls run in float8."""
        return self.fp8_forward is not None

    @property
    def kind_text(self) -> str:
        """The kind as the table shows it: ``norm (class name)``; a framework's own class: ``norm``."""
        if self.kind is None:
            shown = (self.kind_source or "").startswith("[kinds]") or NOT_INFERRED in (self.kind_source or "")
            return f"- ({self.kind_source})" if shown else "-"
        if self.kind_source in (None, "framework class"):
            return self.kind
        return f"{self.kind} ({self.kind_source})"

    @property
    def decided_by(self) -> str:
        """The rule, in words: ``keep_float32[0] kind:norm (via encoder)``."""
        if self.rule == "default":
            return "default"
        text = f"{self.rule} {self.pattern}" if self.pattern else self.rule
        if self.inherited_from is None:
            return text
        return text + f" (via {self.inherited_from or 'the model'})"

    def key(self) -> tuple[Any, ...]:
        """What must agree when the same policy is planned in two frameworks."""
        return (self.path, self.kind, self.compute_dtype, self.param_dtype, self.output_dtype,
                self.rule, self.inherited_from, self.fp8_forward, self.fp8_backward, self.fp8_scaling)


@dataclass(frozen=True)
class Plan:
    """The per-layer dtype plan of a model under a policy. Prints as a table; ``to_json()``."""

    rows: tuple[PlanRow, ...]
    policy: Policy
    framework: str | None = None
    unmatched_rules: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    _index: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {r.path: i for i, r in enumerate(self.rows)})

    def __getitem__(self, path: str) -> PlanRow:
        try:
            return self.rows[self._index[path]]
        except KeyError:
            raise KeyError(f"no layer {path!r} in the plan") from None

    def __contains__(self, path: object) -> bool:
        return path in self._index

    def __iter__(self) -> Iterator[PlanRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def summary(self) -> dict[str, int]:
        """Parameters per compute dtype."""
        counts: dict[str, int] = {}
        for r in self.rows:
            counts[r.compute_dtype] = counts.get(r.compute_dtype, 0) + r.param_count
        return counts

    def table(self, *, only_ruled: bool = False) -> str:
        """The Plan as a text table; ``only_ruled`` hides rows the defaults decided.

        Each row's note, and a kind source too long for its column, is a numbered footnote under
        the table (the row's ``notes`` column gives the numbers; the same text is printed once); a
        model too deep for full paths in 120 characters is shown as a tree (:mod:`.plan_table`).
        ``to_json()`` keeps every note on every row.
        """
        p = self.policy
        ls = p.resolved_loss_scale
        head = [
            f"Plan{' (' + self.framework + ')' if self.framework else ''}: compute {p.compute_dtype}, "
            f"params {p.param_dtype}, output {p.output_dtype}, reduce {p.reduce_dtype}, "
            f"loss scale {ls.mode}" + (f" from {ls.initial_scale:g}" if ls.mode in ("dynamic", "static") else "")
            + (f", fp8 {p.fp8.forward}/{p.fp8.backward} {p.fp8.scaling}" if p.fp8.enabled else ""),
        ]
        rows = [r for r in self.rows if not (only_ruled and r.rule == "default")]
        tail = []
        totals = self.summary()
        total = sum(totals.values())
        if total:
            tail.append("parameters by compute dtype: " + ", ".join(
                f"{k} {v} ({100 * v / total:.1f}%)" for k, v in sorted(totals.items())))
        for label in self.unmatched_rules:
            tail.append(f"warning: {label} matches no layer")
        tail.extend(f"note: {n}" for n in self.notes)
        return render_plan(rows, p, head[0], tail)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return {
            "framework": self.framework,
            "policy": self.policy.to_dict(),
            "rows": [asdict(r) for r in self.rows],
            "unmatched_rules": list(self.unmatched_rules),
            "notes": list(self.notes),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        return cls(
            rows=tuple(PlanRow(**{**r, "other_ops": tuple(r.get("other_ops", ()))}) for r in data["rows"]),
            policy=Policy.from_dict(data["policy"]),
            framework=data.get("framework"),
            unmatched_rules=tuple(data.get("unmatched_rules", ())),
            notes=tuple(data.get("notes", ())),
        )

    def differences(self, other: "Plan") -> list[str]:
        """Row-by-row disagreements on path, kind, dtypes and deciding rule (empty: same plan)."""
        out = []
        mine, theirs = {r.path: r for r in self.rows}, {r.path: r for r in other.rows}
        for path in mine.keys() - theirs.keys():
            out.append(f"{path}: only in {self.framework or 'the first plan'}")
        for path in theirs.keys() - mine.keys():
            out.append(f"{path}: only in {other.framework or 'the second plan'}")
        names = ("path", "kind", "compute_dtype", "param_dtype", "output_dtype", "rule", "inherited_from",
                 "fp8_forward", "fp8_backward", "fp8_scaling")
        for path in mine.keys() & theirs.keys():
            for name, a, b in zip(names, mine[path].key(), theirs[path].key()):
                if a != b:
                    out.append(f"{path}: {name} {a!r} != {b!r}")
        return sorted(out)


#: the rule of a row whose dtypes the model's author fixed (:attr:`Layer.fixed`)
BY_MODEL = "set by the model"
_BY_MODEL = -2  # its decision's index (rules count from 0; -1 is "no rule")


def _or_fixed(decided: tuple[int, Any] | None, layer: Layer) -> tuple[int, Any] | None:
    return decided if decided is not None or layer.fixed is None else (_BY_MODEL, layer.fixed)


class _RuleIndex:
    """Finds the last rule matching a layer without trying every rule on every layer.

    Exact paths, kinds and class names are dict lookups; globs with a literal first segment
    are only tried on paths starting with it; the rest are tried newest rule first, stopping
    as soon as no remaining rule could beat the best match found.
    """

    def __init__(self, rules: "list[list[Pattern]]"):
        self.exact: dict[str, int] = {}
        self.kinds: dict[str, int] = {}
        self.types: dict[str, int] = {}
        self.by_prefix: dict[str, list[tuple[int, Pattern]]] = {}
        self.anywhere: list[tuple[int, Pattern]] = []
        for idx, patterns in enumerate(rules):  # increasing idx: later rules overwrite
            for p in patterns:
                if p.target == "kind":
                    self.kinds[p.value] = idx  # type: ignore[index]
                elif p.target == "type":
                    self.types[p.value] = idx  # type: ignore[index]
                elif p.regex is None:
                    self.exact[p.value] = idx  # type: ignore[index]
                elif p.prefix is not None:
                    self.by_prefix.setdefault(p.prefix, []).append((idx, p))
                else:
                    self.anywhere.append((idx, p))
        self._candidates: dict[str, list[tuple[int, Pattern]]] = {}

    def winner(self, layer: Layer) -> int:
        """Index of the last rule matching ``layer``, or -1."""
        path = layer.path
        best = max(self.exact.get(path, -1), self.kinds.get(layer.kind, -1) if layer.kind else -1,
                   self.types.get(layer.class_name, -1))
        first = path.split(".", 1)[0]
        candidates = self._candidates.get(first)
        if candidates is None:
            candidates = sorted(self.anywhere + self.by_prefix.get(first, []), key=lambda t: -t[0])
            self._candidates[first] = candidates
        for idx, p in candidates:
            if idx <= best:
                break
            if p.regex.fullmatch(path) is not None:  # type: ignore[union-attr]
                return idx
        return best


class RowResolver:
    """:func:`build_plan`'s resolution one layer at a time, for backends that meet layers while tracing.

    The rules are compiled once; ``row(chain)`` resolves the last layer of ``chain`` (the model's
    root down to that layer) exactly as :func:`build_plan` would in a model holding those layers.

    Example:
        >>> from ampbridge import Layer, Policy
        >>> r = RowResolver(Policy(compute_dtype="bfloat16", keep_float32=("encoder",)))
        >>> row = r.row([Layer(""), Layer("encoder"), Layer("encoder.fc", "linear")])
        >>> row.compute_dtype, row.decided_by
        ('float32', 'keep_float32[0] encoder (via encoder)')
    """

    def __init__(self, policy: Policy):
        if policy.phases:
            policy = policy.at(step=0, epoch=0)
        self.policy = policy
        self.compiled = [(label, rule, [compile_pattern(m) for m in rule.match]) for label, rule in policy.rules]
        self.index = _RuleIndex([patterns for _, _, patterns in self.compiled])
        self._decisions: dict[tuple, tuple[int, str] | None] = {}  # for row(): ancestors repeat
        self.kinds = KindTable(policy.kinds)
        self.fp8 = [compile_pattern(m) for m in policy.fp8.match]

    def fp8_match(self, layer: Layer) -> int | None:
        """Index of the first ``[fp8] match`` pattern matching ``layer`` itself, or None."""
        return next((i for i, p in enumerate(self.fp8) if p.matches(layer.path, layer.kind, layer.class_name)),
                    None)

    def layer(self, layer: Layer) -> Layer:
        """``layer`` with the policy's ``[kinds]`` table applied (explicit beats inferred)."""
        if not self.kinds:
            return layer
        listed = self.kinds.kind_of(layer.class_name)
        if listed is KindTable.UNLISTED:
            return layer
        source = "[kinds] table"
        if listed != layer.kind and layer.kind is not None:
            source += f"; overrules {layer.kind} ({layer.kind_source or 'framework class'})"
        return replace(layer, kind=listed, kind_source=source)

    def decision(self, layer: Layer) -> tuple[int, str] | None:
        """(rule index, matching pattern) of the last rule matching ``layer`` itself, or None."""
        idx = self.index.winner(layer)
        if idx < 0:
            return None
        return idx, next(p.text for p in self.compiled[idx][2]
                         if p.matches(layer.path, layer.kind, layer.class_name))

    def _cached_decision(self, layer: Layer) -> tuple[int, str] | None:
        key = (layer.path, layer.kind, layer.class_name)
        try:
            return self._decisions[key]
        except KeyError:
            decided = self._decisions[key] = self.decision(layer)
            return decided

    def matching(self, layer: Layer, among: "set[int]") -> "set[int]":
        """The rules of ``among`` that match ``layer`` (winning or not)."""
        return {i for i in among if any(p.matches(layer.path, layer.kind, layer.class_name)
                                        for p in self.compiled[i][2])}

    def make_row(self, layer: Layer, decided: tuple[int, Any] | None, inherited: str | None) -> PlanRow:
        policy = self.policy
        if decided is not None and decided[0] == _BY_MODEL:
            compute, param = decided[1]
            return PlanRow(layer.path, layer.kind, layer.class_name, layer.param_count, compute, param, compute,
                           BY_MODEL, None, inherited, kind_source=layer.kind_source)
        if decided is None:
            fp8 = policy.fp8
            # pins, overrides and the author's dtypes win: only a row no rule decided runs in float8
            in_fp8 = self.fp8 and self.fp8_match(layer) is not None
            return PlanRow(layer.path, layer.kind, layer.class_name, layer.param_count,
                           policy.compute_dtype, policy.param_dtype, policy.compute_dtype,
                           kind_source=layer.kind_source,
                           fp8_forward=fp8.forward if in_fp8 else None,
                           fp8_backward=fp8.backward if in_fp8 else None,
                           fp8_scaling=fp8.scaling if in_fp8 else None)
        idx, pattern = decided
        label, rule, _ = self.compiled[idx]
        compute = rule.compute_dtype or policy.compute_dtype
        return PlanRow(layer.path, layer.kind, layer.class_name, layer.param_count, compute,
                       rule.param_dtype or policy.param_dtype, rule.output_dtype or compute,
                       label, pattern, inherited, kind_source=layer.kind_source)

    def row(self, chain: "list[Layer] | tuple[Layer, ...]") -> PlanRow:
        """The row of ``chain[-1]``; ``chain[:-1]`` are its ancestors, the model's root first.

        The root's inferred kind is taken away (:func:`~ampbridge.core.kinds.settle_kinds`); what a
        container holds is not known from a chain: a backend settles kinds on the whole tree first.
        """
        if self.kinds:
            chain = [self.layer(link) for link in chain]
        if chain and not chain[0].path and chain[0].kind is not None:
            chain = settle_kinds(chain[:1]) + list(chain[1:])
        layer = chain[-1]
        decided = _or_fixed(self._cached_decision(layer), layer)
        if decided is not None:
            return self.make_row(layer, decided, None)
        for ancestor in reversed(chain[:-1]):
            decided = _or_fixed(self._cached_decision(ancestor), ancestor)
            if decided is not None:
                return self.make_row(layer, decided, ancestor.path)
        return self.make_row(layer, None, None)


def build_plan(layers: Iterable[Layer], policy: Policy, *, framework: str | None = None,
               adjust: Callable[[PlanRow], PlanRow] | None = None, notes: Iterable[str] = (),
               warn: bool = True) -> Plan:
    """Match layers against the policy's rules (see the module docstring for the order).

    ``adjust`` lets a backend correct a row where its framework overrides the request (torch's
    autocast runs some ops in float32 whatever is asked); ``warn`` emits
    :class:`UnmatchedRuleWarning` for each rule that matches no layer, and for each ``kind:`` rule
    whose kind some classes of the model seem to have by name but were not given (see
    :func:`unrecognised_kinds`): once per policy and model, however often the model is planned.
    """
    resolver = RowResolver(policy)
    layers = [resolver.layer(layer) for layer in layers] if resolver.kinds else list(layers)
    layers = settle_kinds(layers)  # explicit kinds first: they may settle what a container holds
    policy = resolver.policy
    decisions, pending = _decisions(resolver, layers, len(resolver.compiled))
    rows = []
    for layer in layers:
        decided, inherited = decisions.get(layer.path), None
        if decided is None:
            parent = layer.path
            while "." in parent and decided is None:
                parent = parent.rsplit(".", 1)[0]
                decided = decisions.get(parent)
            if decided is not None:
                inherited = parent
            elif layer.path and "" in decisions:
                decided, inherited = decisions[""], ""
        row = resolver.make_row(layer, decided, inherited)
        rows.append(adjust(row) if adjust else row)

    unmatched = _unmatched(resolver, layers, pending)
    missed = unrecognised_kinds(layers, resolver)
    unlisted = resolver.kinds.unmatched(layer.class_name for layer in layers) if resolver.kinds else []
    broad = broad_rules(rows, resolver)
    notes = tuple(notes) + tuple(missed) + tuple(unlisted) + tuple(broad)
    if warn and (unmatched or missed or unlisted or broad):
        model_key = (policy, framework, hash(tuple((layer.path, layer.class_name) for layer in layers)))
        for text in [f"{t} matches no layer of the model (a typo?)" for t in unmatched] + missed + unlisted:
            _warn_once_per_model(model_key, text)
        for text in broad:
            _warn_once_per_model(model_key, text, BroadRuleWarning)
    return Plan(tuple(rows), policy, framework, unmatched, notes)


def _decisions(resolver: RowResolver, layers: list[Layer],
               n_rules: int) -> tuple[dict[str, tuple[int, Any]], set[int]]:
    """Each layer's own decision (path -> (rule index, pattern) or (_BY_MODEL, fixed)), and the
    rules seen matching no layer."""
    pending = set(range(n_rules))  # rules not yet seen matching any layer
    decisions: dict[str, tuple[int, Any]] = {}  # path -> (rule index, matching pattern) or (_BY_MODEL, fixed)
    for layer in layers:
        decided = resolver.decision(layer)
        if decided is not None:
            decisions[layer.path] = decided
            pending.discard(decided[0])
        elif layer.fixed is not None:
            decisions[layer.path] = (_BY_MODEL, layer.fixed)
        # a rule that loses to a later one still counts as matching (it is not a typo)
        if pending:
            pending -= resolver.matching(layer, pending)
    return decisions, pending


def _unmatched(resolver: RowResolver, layers: list[Layer], pending: set[int]) -> tuple[str, ...]:
    # rules and [fp8] patterns no layer matched: named in the Plan and warned about (a typo?)
    unmatched = tuple(f"{label} ({', '.join(rule.match)})"
                      for i, (label, rule, _) in enumerate(resolver.compiled) if i in pending)
    if resolver.fp8:
        used = {i for layer in layers for i, p in enumerate(resolver.fp8)
                if p.matches(layer.path, layer.kind, layer.class_name)}
        unmatched += tuple(f"fp8.match[{i}] ({p.text})" for i, p in enumerate(resolver.fp8) if i not in used)
    return unmatched


#: the share of a model's parameters a rule may reach through inheritance before it is said
BROAD_SHARE = 0.5


def broad_rules(rows: "Iterable[PlanRow]", resolver: RowResolver) -> list[str]:
    """One line per rule whose reach through inheritance (rows that follow it because a container
    above them matched, not because it matched them) holds more than :data:`BROAD_SHARE` of the
    model's parameters: the rule, the containers (largest reach first) and the share.

    Example:
        >>> from ampbridge import Policy
        >>> rows = [PlanRow("", None, "", 0, "float16", "float32", "float16"),
        ...         PlanRow("pre", "norm", "PreNorm", 0, "float32", "float32", "float32", "keep_float32[0]",
        ...                 "kind:norm"),
        ...         PlanRow("pre.fc", "linear", "Linear", 90, "float32", "float32", "float32", "keep_float32[0]",
        ...                 "kind:norm", "pre"),
        ...         PlanRow("head", "linear", "Linear", 10, "float16", "float32", "float16")]
        >>> resolver = RowResolver(Policy(compute_dtype="float16", keep_float32=("kind:norm",)))
        >>> broad_rules(rows, resolver)[0].split(" through")[0]
        "keep_float32[0] (kind:norm) reaches 90.0% of the model's parameters"
    """
    rows = list(rows)
    total = sum(r.param_count for r in rows)
    if total <= 0:
        return []
    reach: dict[str, dict[str, int]] = {}  # rule label -> container path -> parameters it reaches
    for r in rows:
        if r.inherited_from is not None and r.rule not in ("default", BY_MODEL):
            by_container = reach.setdefault(r.rule, {})
            by_container[r.inherited_from] = by_container.get(r.inherited_from, 0) + r.param_count
    lines = []
    matches = {label: rule.match for label, rule, _ in resolver.compiled}
    for label, by_container in reach.items():
        reached = sum(by_container.values())
        if reached <= BROAD_SHARE * total:
            continue
        ranked = sorted(by_container, key=lambda p: (-by_container[p], p))
        shown = ", ".join(p or "(root)" for p in ranked[:5])
        shown += f" and {len(ranked) - 5} more" if len(ranked) > 5 else ""
        lines.append(f"{label} ({', '.join(matches.get(label, ()))}) reaches {100 * reached / total:.1f}% of the "
                     f"model's parameters through the container(s) it matches ({shown}): everything a matched "
                     f"container holds follows the rule; name the layers themselves if that is not meant")
    return lines


#: (policy, framework, model signature, message) already said; bounded (oldest forgotten first)
_SAID: dict[tuple, None] = {}


def _warn_once_per_model(model_key: tuple, text: str, category: type[Warning] = UnmatchedRuleWarning) -> None:
    key = model_key + (text,)
    if key in _SAID:
        return
    if len(_SAID) >= 4096:
        del _SAID[next(iter(_SAID))]
    _SAID[key] = None
    warnings.warn(text, category, stacklevel=outside_stacklevel())


def unrecognised_kinds(layers: "list[Layer]", resolver: RowResolver) -> list[str]:
    """One line per ``kind:K`` rule for classes whose name suggests ``K`` but that got no kind.

    A class with no kind whose name holds the kind's word (``norm``, ``embed``, ``attention``/``attn``,
    ``softmax``, ``linear``/``dense``, ``conv``, ``lstm``/``gru``/``rnn``) is likely a layer the
    rule was meant for; classes whose missing kind was decided (``none`` in ``[kinds]``, a rotary
    embedding) are not listed.
    """
    wanted = {p.value: label for label, _, patterns in resolver.compiled for p in patterns
              if p.target == "kind"}
    if not wanted:
        return []
    lines = []
    for kind, label in wanted.items():
        names = sorted({layer.class_name for layer in layers if layer.kind is None and layer.kind_source is None
                        and layer.class_name and looks_like(kind, layer.class_name)})
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            lines.append(f"{label} (kind:{kind}): class(es) {shown} look like {kind} by name but were not "
                         f"recognised, so the rule does not reach them; name them in the policy's [kinds] table "
                         f"({kind} = [{json.dumps(names[0])}]) or register them (register_kind)")
    return lines


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cycle collector while a backend builds or walks a large model's Plan.

    A 10,000-module model means hundreds of thousands of live objects; every full collection
    triggered by the allocations of planning walks all of them again (measured: Flax's NNX clone
    of 10,000 modules takes 2.5 s with the collector, 1.3 s without). The previous state comes back
    on exit; cycles made meanwhile are collected at the next collection after that.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def layers_from_data(data: Any, source: str = "<layers>") -> list[Layer]:
    """Layers from a JSON-like list: ``[{"path": ..., "kind": ..., "class": ..., "params": ...}]``.

    ``class_name``/``class`` and ``param_count``/``params`` are both accepted.
    """
    if isinstance(data, Mapping) and "layers" in data:
        data = data["layers"]
    if not isinstance(data, list):
        raise ValueError(f"{source}: expected a list of layer objects")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, Mapping) or "path" not in item:
            raise ValueError(f"{source}: layer [{i}] must be an object with at least a 'path'")
        unknown = set(item) - {"path", "kind", "class", "class_name", "params", "param_count"}
        if unknown:
            raise ValueError(f"{source}: layer [{i}] has unknown keys {sorted(unknown)}; accepted: "
                             "path, kind, class (or class_name), params (or param_count)")
        try:
            out.append(Layer(str(item["path"]), item.get("kind"),
                             str(item.get("class", item.get("class_name", ""))),
                             int(item.get("params", item.get("param_count", 0)))))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: layer [{i}]: {e}") from None
    return out


def with_note(row: PlanRow, note: str, **changes: Any) -> PlanRow:
    """A row with some dtypes changed and a note saying why (for backends' ``adjust``)."""
    return replace(row, note=note, **changes)


# --- a pinned layer's output meeting its caller's stream (the same rule and words in every backend) ---

def stream_note(stream: str, caller: str, output: str) -> str:
    """The note of a row whose ``output`` dtype differs from the ``stream`` dtype its ``caller``'s own
    code computes in: a layer emits what it computes, and where its output meets the stream (``x +
    residual``) the two promote to the wider dtype, as torch and jnp promote (TensorFlow does too,
    inside an applied Keras model: ampbridge turns on its numpy-style promotion there).

    Example:
        >>> stream_note("float16", "block", "float32").split(": ")[0]
        "called from block's own code, which computes in float16"
    """
    wider = "float64" if "float64" in (stream, output) else "float32"
    return (f"called from {caller or 'the model'}'s own code, which computes in {stream}: its {output} output "
            f"meets that stream and promotes it to {wider} on every backend (TensorFlow included, by ampbridge); "
            f'an [[override]] with output_dtype = "{stream}" returns it to the stream instead')


def stream_notes(policy: Policy, caller_of: Callable[[str], "str | None"]) -> Callable[[PlanRow], "str | None"]:
    """``note(row) -> str | None`` for the requested rows, fed parents first: :func:`stream_note` for
    a row whose output dtype differs from the compute dtype of ``caller_of(row.path)`` (the layer
    whose own code calls it; None where a graph or a sequential container feeds it, which casts
    each layer's inputs itself), unless its rule sets ``output_dtype`` or its dtypes are the
    model's own. Each backend says who calls whom; the rule and the words are the same.

    Example:
        >>> from ampbridge import Policy
        >>> note = stream_notes(Policy(compute_dtype="float16", keep_float32=("norm",)),
        ...                     lambda p: p.rsplit(".", 1)[0] if "." in p else ("" if p else None))
        >>> rows = [PlanRow(p, None, "", 0, c, "float32", c) for p, c in (("", "float16"), ("norm", "float32"))]
        >>> [note(r) is not None for r in rows]
        [False, True]
    """
    if policy.phases:
        policy = policy.at(step=0, epoch=0)
    # keep_float32 entries say float32 for all three dtypes; only an [[override]] asks for an output
    explicit = {label for label, rule in policy.rules if label.startswith("override") and rule.output_dtype}
    compute: dict[str, str] = {}

    def note(row: PlanRow) -> str | None:
        compute[row.path] = row.compute_dtype
        caller = caller_of(row.path)
        if caller is None or caller not in compute or row.rule == BY_MODEL or row.rule in explicit:
            return None
        if compute[caller] == row.output_dtype:
            return None
        return stream_note(compute[caller], caller, row.output_dtype)

    return note


# --- traced rows: what one forward really ran (each backend's trace room observes, these write) ---

def join_notes(*parts: str | None) -> str:
    """Notes joined with ``; `` (empty parts left out)."""
    return "; ".join(p for p in parts if p)


#: a traced row's note where its layer did not run / ran but no floating-point op of it was seen
NOT_RUN = "did not run in the traced forward"
NO_OP = "traced: its forward ran no floating-point op (an eval-mode Dropout returns its input): the static row"


def not_run(row: PlanRow) -> PlanRow:
    """The row of a layer the traced forward never called."""
    return with_note(row, join_notes(row.note, NOT_RUN))


def idle_rules(traced: Plan, ran: "set[str]", *, warn: bool = True) -> list[str]:
    """One line per rule whose rows (those it matched and those inheriting from them) all are not in
    ``ran`` (the paths whose forward a traced forward called): it changes nothing that runs (Mamba
    reads its ``conv1d`` and ``dt_proj`` weights directly, never calling their forward). Said once
    per policy and model (:class:`~ampbridge.IdleRuleWarning`)."""
    followers: dict[str, list[PlanRow]] = {}
    for r in traced.rows:
        if r.rule not in ("default", BY_MODEL):
            followers.setdefault(r.rule, []).append(r)
    lines = []
    matches = {label: rule.match for label, rule in traced.policy.rules}
    for label, rows in followers.items():
        if not any(r.path in ran for r in rows):
            paths = [r.path for r in rows if r.inherited_from is None]
            shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
            lines.append(f"{label} ({', '.join(matches.get(label, ()))}) has no effect: the layers it matches "
                         f"({shown}) never ran their forward in the traced forward (the model reads their "
                         f"weights directly?)")
    if warn and lines:
        key = (traced.policy, traced.framework, hash(tuple((r.path, r.class_name) for r in traced.rows)))
        for line in lines:
            _warn_once_per_model(key, line, IdleRuleWarning)
    return lines


def traced_row(row: PlanRow, compute: Iterable[str] | None, output: Iterable[str] | None) -> PlanRow:
    """The row as one forward ran it: where exactly one dtype was observed for a column and it
    differs from the row's, it replaces it, and the note says ``traced: ran compute X, output Y``;
    none or several observed dtypes leave the column as the row has it.

    Example:
        >>> r = PlanRow("norm", "norm", "LayerNorm", 8, "bfloat16", "float32", "bfloat16", "default")
        >>> t = traced_row(r, {"float32"}, {"bfloat16"})
        >>> t.compute_dtype, t.note
        ('float32', 'traced: ran compute float32')
    """
    changes: dict[str, str] = {}
    for column, seen in (("compute_dtype", compute), ("output_dtype", output)):
        seen = set(seen or ())
        if len(seen) == 1 and (dtype := seen.pop()) != getattr(row, column):
            changes[column] = dtype
    if not changes:
        return row
    said = ", ".join(f"{column.split('_')[0]} {dtype}" for column, dtype in changes.items())
    return with_note(row, join_notes(row.note, f"traced: ran {said}"), **changes)


def traced_plan(static: Plan, rows: Iterable[PlanRow], note: str = "traced: dtypes observed in one forward",
                ran: "set[str] | None" = None) -> Plan:
    """``static``'s Plan with its rows replaced by the traced ones, and a Plan note saying so; with
    ``ran`` (the paths whose forward ran), one note per rule whose layers never ran (:func:`idle_rules`,
    warned once)."""
    traced = Plan(tuple(rows), static.policy, static.framework, static.unmatched_rules, static.notes + (note,))
    idle = idle_rules(traced, ran) if ran is not None else []
    return replace(traced, notes=traced.notes + tuple(idle)) if idle else traced
