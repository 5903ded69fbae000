"""Between a monitor's samples (``Monitor.wrap``): the window of unsampled steps kept for replay,
the training state snapshotted and restored (linen arrays; NNX objects changed in place), and the
loss-scale state found in it.

Holds: _Window, _snapshot, _restore, _scale_state.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax

from .loss_scale import AmpState, PackedLossScale, _find_states


def _scale_state(state: tuple, at: int | None = None) -> tuple[PackedLossScale, int]:
    """The loss-scale state in the training state (linen: in ``opt_state``; NNX: the optimizer's)
    and the position of the element holding it (``at``: where it was last time, looked at alone)."""
    x = state[at] if at is not None else None
    if isinstance(x, AmpState):  # the usual linen carry: no walk over the optimizer state
        return x.loss_scale, at
    nnx = sys.modules.get("flax.nnx")
    found = []
    for k, x in enumerate(state if at is None else ()):
        if isinstance(x, AmpState):
            found.append((k, [x.loss_scale]))
        elif nnx is None or not isinstance(x, nnx.Pytree) or isinstance(x, nnx.Optimizer):
            found.append((k, _find_states(x)))
    if at is not None:
        found = [(at, _find_states(state[at]))]
    found = [(k, f) for k, f in found if f]
    if len(found) != 1 or len(found[0][1]) != 1:
        raise ValueError(f"Monitor.wrap: {sum(len(f) for _, f in found)} ampbridge loss-scale states in the "
                         "step's carried state; carry the optimizer state of ampbridge.jax.optimizer (one)")
    return found[0][1][0], found[0][0]


def _snapshot(state: tuple, held: bool) -> Any:
    """The training state as of now, unaffected by later steps: linen's arrays as they are; NNX's
    objects (changed in place) split into a graph and a copy of their state."""
    if not held:
        return state
    nnx = sys.modules["flax.nnx"]
    graphdef, variables = nnx.split(state)
    return graphdef, jax.tree_util.tree_map(lambda a: a, variables)


def _restore(snapshot: Any, held: bool) -> Any:
    """Fresh objects (NNX) or the arrays (linen) from :func:`_snapshot`; the snapshot stays as it was."""
    if not held:
        return snapshot
    nnx = sys.modules["flax.nnx"]
    graphdef, variables = snapshot
    return nnx.merge(graphdef, jax.tree_util.tree_map(lambda a: a, variables))


@dataclasses.dataclass
class _Window:
    """The unsampled steps since a sampled one: what replaying them needs, references only."""

    step: Callable[..., Any]
    carry: int
    held: list[int]  # NNX: the positions of the model/optimizer arguments
    start: Any  # the state after the sampled step (a _snapshot)
    first: int  # the first unsampled step's number
    before: Any  # the loss-scale state after the sampled step
    scale_at: int  # which element of the carried state holds the loss-scale state
    latest: Any = None  # the state after the last step (linen arrays; NNX: the live objects)
    # per step, its other arguments; keywords only where given (one object kept per step: three
    # made Python's garbage collector cost ~2% of a 2.4 ms step in bench_monitor_jax.py)
    inputs: list = dataclasses.field(default_factory=list)
    keywords: dict = dataclasses.field(default_factory=dict)
    states: list = dataclasses.field(default_factory=list)  # per step: its loss-scale state after it

    def call(self, state: tuple, k: int, sample: bool) -> Any:
        rest, kwargs = self.inputs[k], self.keywords.get(k, {})
        if not self.held:
            return self.step(*state, *rest, sample=sample, **kwargs)
        args, it_state, it_rest = [], iter(state), iter(rest)
        for i in range(len(self.held) + len(rest)):
            args.append(next(it_state) if i in self.held else next(it_rest))
        return self.step(*args, sample=sample, **kwargs)
