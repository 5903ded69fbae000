"""Portable kinds for classes no backend table knows: inference from names, the policy's
``[kinds]`` table, and code registrations. Standard library only; every backend uses it.

How a layer's kind is decided (first that answers wins; each answer carries its source, which the
Plan row shows as ``norm (class name)``):

1. the policy's ``[kinds]`` table (``norm = ["LlamaRMSNorm", "re:.*RMSNorm$"]``) on the class name:
   **explicit beats inferred**; where the table and the backend disagree the table wins and the
   source says what was overruled (``[kinds] table; inferred attention``). ``none = [...]`` takes a
   kind away. Applied by the core (:func:`ampbridge.build_plan`), so it is the same in every backend.
2. the layer's ``ampbridge_kind`` attribute, then a backend's ``register_kind(cls, kind)``
   (``"registered"``), then the framework's own classes (``"framework class"``);
3. inference (:func:`infer_kind`) on the class name, then on its bases' names, nearest first
   (``"class name"``, ``"base class LlamaRMSNorm"``), then what a backend can see of its structure
   (``"structure: ..."``; torch: a ``Conv1D`` whose weight is 2-D is a linear map).

What a kind means for a module that holds other modules: the kind says what the module *is* in the
architecture, by its name, whatever it holds. ``BertEmbeddings`` (three lookups, their sum, a
LayerNorm, dropout) is an ``embedding``; ``BertAttention`` (``BertSelfAttention`` plus the output
projection and its LayerNorm) and ``BertSelfAttention`` are both ``attention``. A rule on a
container covers everything inside it (the Plan's inheritance), so ``kind:embedding`` keeps BERT's
whole embedding stage in float32 and ``kind:attention`` all of each attention block. Inference
never looks inside a module to name it (holding a LayerNorm does not make a module a norm). Rotary
position "embeddings" (``LlamaRotaryEmbedding``) are no ``embedding``: they compute cos/sin of the
positions, there is no table to look up.

Inference is cautious, explicit rules are not (:func:`settle_kinds`, applied by the core to every
backend's layers): a kind inferred from a name is *not* given to the model itself (its root), nor
to a module that holds layers of a compute kind it is not built from. A ``norm``, ``embedding`` or
``softmax`` holds no ``linear``, ``conv``, ``attention`` or ``recurrent`` layer (the common
``PreNorm(dim, fn)`` wrapper holds the block it normalises for; diffusers' ``TimestepEmbedding``
is an MLP, no table); an ``attention`` holds no ``recurrent`` one. Such a module gets no kind, and
its row says why (``- (norm by name, not inferred: holds linear)``). ``[kinds]``, ``type:`` rules,
paths, ``register_kind`` and ``ampbridge_kind`` still give it one.

Example:
    >>> infer_kind(["LlamaRMSNorm", "Module"])
    ('norm', 'class name')
    >>> infer_kind(["MyBlock", "T5LayerNorm", "Module"])
    ('norm', 'base class T5LayerNorm')
    >>> infer_kind(["T5DenseActDense", "Module"], leaf=False)
    (None, None)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .matching import KINDS

__all__ = ["LEAF_KINDS", "ROTARY", "infer_kind", "is_inferred", "settle_kinds", "NOT_INFERRED", "KindTable", "KindRegistry", "SUGGESTIVE", "looks_like", "NO_KIND"]

#: the ``[kinds]`` key that takes a kind away (``none = ["Foo"]``)
NO_KIND = "none"

# class-name suffixes, per kind; tried on the class name, then on each base's name
_SUFFIXES: tuple[tuple[str, "re.Pattern[str]"], ...] = (
    ("norm", re.compile(r"(?:Norm|Normali[sz]ation)(?:[123][dD])?$")),
    ("embedding", re.compile(r"(?:Embedding|Embeddings|Embed|Embeds|Embedder)$")),
    ("attention", re.compile(r"(?:Attention|Attn)$")),
    ("softmax", re.compile(r"(?:Softmax|Softmin)(?:[123][dD])?$")),
    ("linear", re.compile(r"(?:Linear|Dense|DenseGeneral|LinearGeneral)$")),
    ("conv", re.compile(r"(?:Conv|Convolution)(?:Transpose)?(?:[123][dD])?$")),
    ("recurrent", re.compile(r"(?:LSTM|GRU|RNN)(?:Cell)?$")),
)
# names that end like a kind but are none: position functions with no table to look up
_NOT_A_KIND = re.compile(r".*(?:Rotary|RoPE|Rope)\w*$")
# generic bases that say nothing (torch, Keras, Flax, Python)
_GENERIC = frozenset({"object", "Module", "Layer", "Model", "Operation", "KerasSaveable", "Trackable",
                      "AutoTrackable", "Sequential", "ModuleList", "ModuleDict", "Object", "Pytree",
                      "Generic", "ABC", "PreTrainedModel", "GenerationMixin"})

#: lower-case fragments of class names that suggest a kind (for the "not recognised" warning)
SUGGESTIVE: Mapping[str, tuple[str, ...]] = {
    "norm": ("norm",), "embedding": ("embed",), "attention": ("attention", "attn"), "softmax": ("softmax",),
    "linear": ("linear", "dense"), "conv": ("conv",), "recurrent": ("lstm", "gru", "rnn"),
}


def _by_name(name: str) -> str | None:
    if _NOT_A_KIND.fullmatch(name):
        return None
    for kind, pattern in _SUFFIXES:
        if pattern.search(name):
            return kind
    return None


#: kinds that name one operation: inferred from a name only for a layer holding no other layers
LEAF_KINDS = frozenset({"linear", "conv", "softmax", "recurrent"})
#: the source of a deliberate "no kind" (rows show it; the "not recognised" warning skips it)
ROTARY = "class name: a rotary position encoding (no table to look up), no kind"


def infer_kind(names: Sequence[str], *, leaf: bool | None = None) -> tuple[str | None, str | None]:
    """``(kind, how)`` from a class name and its bases' names (nearest first), or ``(None, None)``.

    ``names[0]`` is the class's own name (``"class name"``); the rest are its bases in method
    resolution order (``"base class NAME"``); generic bases (``Module``, ``Layer``) are skipped.
    ``leaf=False`` (the layer holds other layers) infers no :data:`LEAF_KINDS` kind: T5's
    ``T5DenseActDense`` is an MLP block, not a linear map; ``None`` (unknown) infers them.
    """
    for i, name in enumerate(names):
        if not name or name in _GENERIC:
            continue
        if i == 0 and _NOT_A_KIND.fullmatch(name):
            return None, ROTARY  # a rotary embedding subclassing an ``Embedding`` is still none
        kind = _by_name(name)
        if kind is not None and not (leaf is False and kind in LEAF_KINDS):
            return kind, "class name" if i == 0 else f"base class {name}"
    return None, None


#: the compute kinds (layers that do the model's arithmetic) a module inferred as each kind may hold;
#: holding any other compute kind means the name describes a wrapper, not the layer (settle_kinds)
COMPUTE_KINDS = frozenset({"linear", "conv", "attention", "recurrent"})
_MAY_HOLD: Mapping[str, frozenset[str]] = {
    "norm": frozenset(), "embedding": frozenset(), "softmax": frozenset(),
    "attention": frozenset({"linear", "conv", "attention"}),  # projections; SegFormer's reduction conv
}
#: how a row of a module whose name suggested a kind it was not given begins its kind source
NOT_INFERRED = "not inferred"


def is_inferred(source: str | None) -> bool:
    """Whether a kind source is name or structure inference (not a framework class, not explicit)."""
    return bool(source) and (source == "class name" or source.startswith(("base class ", "structure:")))


def settle_kinds(layers: Sequence[Any]) -> list[Any]:
    """``layers`` (neutral ``Layer`` descriptors, any order) with cautious inference applied: an
    inferred kind is taken from the root (path ``""``) and from a module holding a compute kind it
    may not hold (:data:`_MAY_HOLD`); its ``kind_source`` then says which kind its name suggested and
    why it was not given (``norm by name, not inferred: holds linear``). Explicit kinds are kept.

    A module's holdings are its descendants by path (the nearest listed ancestor owns a layer),
    with their own kinds as settled here, deepest first.

    Example:
        >>> from ampbridge.core.plan import Layer
        >>> out = settle_kinds([Layer("", None, "ViT"), Layer("pre", "norm", "PreNorm", 0, "class name"),
        ...                     Layer("pre.norm", "norm", "LayerNorm", 8, "framework class"),
        ...                     Layer("pre.fn", "linear", "Linear", 72, "framework class")])
        >>> out[1].kind, out[1].kind_source
        (None, 'norm by name, not inferred: holds linear')
    """
    from dataclasses import replace

    paths = {layer.path for layer in layers}
    held: dict[str, set[str]] = {}
    settled: dict[int, Any] = {}
    deepest_first = sorted(range(len(layers)), key=lambda i: layers[i].path.count(".") + (1 if layers[i].path else 0),
                           reverse=True)
    for i in deepest_first:
        layer = layers[i]
        below = held.get(layer.path, set())
        why = None
        if layer.kind is not None and is_inferred(layer.kind_source):
            if not layer.path:
                why = "the model itself"
            else:
                other = sorted((below & COMPUTE_KINDS) - _MAY_HOLD.get(layer.kind, COMPUTE_KINDS))
                why = f"holds {', '.join(other)}" if other else None
        if why is not None:
            layer = replace(layer, kind=None, kind_source=f"{layer.kind} by name, {NOT_INFERRED}: {why}")
        settled[i] = layer
        parent = _nearest_ancestor(layer.path, paths)
        if parent is not None:
            held.setdefault(parent, set()).update(below, (layer.kind,) if layer.kind else ())
    return [settled[i] for i in range(len(layers))]


def _nearest_ancestor(path: str, paths: "set[str]") -> str | None:
    while path:
        path = path.rsplit(".", 1)[0] if "." in path else ""
        if path in paths:
            return path
    return None


def looks_like(kind: str, class_name: str) -> bool:
    """Whether a class name suggests ``kind`` (``"NormedProj"`` suggests ``norm``)."""
    low = class_name.lower()
    return any(frag in low for frag in SUGGESTIVE.get(kind, ()))


class KindTable:
    """The policy's ``[kinds]`` table compiled: exact class names first, then ``re:`` patterns in
    the table's order. ``kind_of(class_name)`` is the kind (``None`` for ``none = [...]``) or the
    sentinel :data:`KindTable.UNLISTED`.

    Example:
        >>> t = KindTable((("norm", ("LlamaRMSNorm", "re:.*RMSNorm$")), ("none", ("Odd",))))
        >>> t.kind_of("LlamaRMSNorm"), t.kind_of("GemmaRMSNorm"), t.kind_of("Odd"), t.kind_of("X") is t.UNLISTED
        ('norm', 'norm', None, True)
    """

    UNLISTED: Any = object()

    def __init__(self, entries: Iterable[tuple[str, Sequence[str]]]):
        self.exact: dict[str, str] = {}
        self.patterns: list[tuple["re.Pattern[str]", str]] = []
        self.entries: list[tuple[str, str]] = []  # (kind, name or "re:..."), in the table's order
        for kind, names in entries:
            for name in names:
                self.entries.append((kind, name))
                if name.startswith("re:"):
                    self.patterns.append((re.compile(name[3:]), kind))
                else:
                    self.exact.setdefault(name, kind)
        self._cache: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return bool(self.exact or self.patterns)

    def unmatched(self, class_names: Iterable[str]) -> list[str]:
        """One line per entry that names no class of ``class_names`` (a typo, another model's class),
        with a did-you-mean among those classes where one is close.

        Example:
            >>> table = KindTable((("norm", ("LlamaRMSNrom", "re:.*Norm$")),))
            >>> print(*table.unmatched(["LlamaRMSNorm", "Linear"]))
            [kinds] norm = "LlamaRMSNrom" matches no class of the model (a typo?); did you mean 'LlamaRMSNorm'?
        """
        from .matching import did_you_mean

        names = sorted(set(class_names))
        lines = []
        for kind, entry in self.entries:
            if entry.startswith("re:"):
                rx = re.compile(entry[3:])
                if any(rx.fullmatch(n) for n in names):
                    continue
                hint = None
            elif entry in names:
                continue
            else:
                hint = did_you_mean(entry, names)
            lines.append(f'[kinds] {kind} = "{entry}" matches no class of the model (a typo?)'
                         + (f"; {hint}" if hint else ""))
        return lines

    def kind_of(self, class_name: str) -> Any:
        try:
            return self._cache[class_name]
        except KeyError:
            pass
        found = self.exact.get(class_name, self.UNLISTED)
        if found is self.UNLISTED:
            found = next((k for rx, k in self.patterns if rx.fullmatch(class_name)), self.UNLISTED)
        if found is not self.UNLISTED and found == NO_KIND:
            found = None
        self._cache[class_name] = found
        return found


class KindRegistry:
    """A backend's ``register_kind(cls, kind)`` registrations, looked up along a class's bases.

    Example:
        >>> class Base: pass
        >>> class Child(Base): pass
        >>> r = KindRegistry(); r.register(Base, "norm")
        >>> r.lookup(Child)
        'norm'
    """

    def __init__(self) -> None:
        self._kinds: dict[type, str | None] = {}

    def register(self, cls: type, kind: str | None) -> None:
        if not isinstance(cls, type):
            raise TypeError(f"register_kind needs a class; received {type(cls).__name__} {cls!r}")
        if kind is not None and kind not in KINDS:
            from .matching import did_you_mean

            hint = did_you_mean(str(kind), KINDS)
            raise ValueError(f"register_kind({cls.__name__}, {kind!r}): unknown kind" + (f"; {hint}" if hint else "")
                             + f"; accepted: {', '.join(KINDS)} or None (no kind)")
        self._kinds[cls] = kind

    def unregister(self, cls: type) -> None:
        self._kinds.pop(cls, None)

    _MISSING: Any = object()

    def lookup(self, cls: type) -> Any:
        """The registered kind of ``cls`` or its nearest registered base, else ``KindRegistry._MISSING``."""
        if not self._kinds:
            return self._MISSING
        for c in getattr(cls, "__mro__", (cls,)):
            if c in self._kinds:
                return self._kinds[c]
        return self._MISSING

    def found(self, value: Any) -> bool:
        return value is not self._MISSING
