"""Between a monitor's samples (``Monitor.wrap``): the window of unsampled steps kept for replay,
the training state snapshotted and restored (linen arrays; NNX objects changed in place), and the
loss-scale state found in it.

Holds: Window (what the monitor uses), _snapshot, _restore, _scale_state.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax

from .loss_scale import AmpState, PackedLossScale, find_states


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
            found.append((k, find_states(x)))
    if at is not None:
        found = [(at, find_states(state[at]))]
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
class Window:
    """The unsampled steps since a sampled one: what replaying them needs, references only.

    The monitor opens one after a sampled step (:meth:`open`), adds each unsampled step to it
    (:meth:`add`), and, to replay, restores its start (:meth:`restored`) and copies states
    (:meth:`copied`); :meth:`following` is the window after its last step.
    """

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

    @classmethod
    def open(cls, step: Callable[..., Any], carry: int, held: list[int], state: tuple, first: int,
             scale_at: int | None = None) -> "Window":
        """The window starting from ``state`` (its first step numbered ``first``): the state
        snapshotted, its loss-scale state found (at ``scale_at`` where known)."""
        start = _snapshot(state, bool(held))
        return cls(step, carry, held, start, first, *_scale_state(state, scale_at), state)

    def add(self, rest: tuple, kwargs: dict, state: tuple) -> None:
        """One more unsampled step: its other arguments and the training state after it."""
        if kwargs:
            self.keywords[len(self.inputs)] = kwargs
        self.inputs.append(rest)
        self.states.append(_scale_state(state, self.scale_at)[0])
        self.latest = state

    def following(self) -> "Window":
        """The window that starts after this one's last step (none added to it yet)."""
        return Window(self.step, self.carry, self.held, _snapshot(self.latest, bool(self.held)),
                      self.first + len(self.inputs), self.states[-1], self.scale_at, self.latest)

    def restored(self) -> Any:
        """The training state this window started from, fresh (the snapshot stays as it was)."""
        return _restore(self.start, self.held)

    def copied(self, state: Any) -> Any:
        """A copy of ``state`` that a replayed step may change (NNX objects) without changing ``state``."""
        return _restore(_snapshot(state, self.held), self.held)

    def call(self, state: tuple, k: int, sample: bool) -> Any:
        rest, kwargs = self.inputs[k], self.keywords.get(k, {})
        if not self.held:
            return self.step(*state, *rest, sample=sample, **kwargs)
        args, it_state, it_rest = [], iter(state), iter(rest)
        for i in range(len(self.held) + len(rest)):
            args.append(next(it_state) if i in self.held else next(it_rest))
        return self.step(*args, sample=sample, **kwargs)
