"""FP8 scaling: the reference algorithm every backend's float8 path follows, in pure Python.

Two scalings, as the ``[fp8]`` table's ``scaling`` names them:

- **current** (torchao's ``Float8LinearConfig`` tensorwise dynamic scaling): each step a tensor's
  scale comes from its own amax, ``scale = fp8_max / max(amax, 1e-12)`` computed in float64 and
  rounded to float32 (torchao's ``amax_to_scale``), then divided by ``2**margin``; the float8 value
  is ``x * scale``. An amax of 0 gives the 1e-12 floor's scale; inf gives 0; NaN gives NaN. A scale
  that the margin makes subnormal is 0 under ``flush_denormals`` (the default, as XLA computes).
- **delayed** (Transformer Engine's ``DelayedScaling``, Keras's ``quantize("float8")``, Flax's
  ``fp8_ops``): each tensor keeps a float32 ``divisor`` (what Keras and Flax store as ``scale``:
  the float8 value is ``x / divisor``) and an amax history. A step computes the new divisor from
  the history *before* this step's amax, in float32 exactly as the three do it::

      sf = (fp8_max / amax) / 2**margin       if amax > 0 and amax is finite
      sf = 1 / divisor                        otherwise (the divisor is kept, up to rounding)
      new divisor = 1 / sf

  where ``amax`` is the history's max (``amax_compute = "max"``) or its newest entry
  (``"most_recent"``, TE's ``history[0]``), and then records this step's amax: the history is rolled
  by one towards the front and its first entry replaced (``roll(h, -1).at[0].set(amax)``). The
  frameworks differ only in which divisor quantizes the step: Keras the previous one, Flax the
  updated one (``quantize_with``); the divisor and history trajectories are the same.

Every arithmetic step is rounded to float32 (:func:`ampbridge.core.loss_scale.f32`: a double
operation on float32 operands rounded once to float32 is the correctly rounded float32 result).
``flush_denormals`` (the default) computes as XLA and TensorFlow do on CPU and GPU, with float32
subnormals as zero (an amax below 2**-126 keeps the divisor; a divisor that would be subnormal is
0): Flax, and Keras on its JAX and TensorFlow backends. Keras on the torch backend, and ampbridge's
own torch delayed scaling (``backends.torch.fp8_delayed``, which quantizes as Flax does), compute with
subnormals (``flush_denormals=False``); the two differ only for amaxes below 2**-126 or above
about 2**118 (e4m3).

Example:
    >>> current_scale(1.0, "e4m3")
    448.0
    >>> s = delayed_initial(4)
    >>> s = delayed_step(s, 2.0, "e4m3"); s.divisor, s.history
    (1.0, (2.0, 0.0, 0.0, 0.0))
    >>> delayed_step(s, 1.0, "e4m3").divisor == f32(1 / f32(448.0 / 2.0))
    True
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .loss_scale import f32

__all__ = ["FP8_MAX", "F32_TINY", "TORCHAO_EPS", "current_scale", "delayed_initial", "delayed_step", "delayed_trajectory",
           "history_amax", "Fp8ScaleState", "amax_of"]

#: the largest finite value of each format (float8_e4m3fn: no inf; float8_e5m2: IEEE-like)
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
#: the smallest normal float32; below it XLA and TensorFlow compute as if 0 (denormals are zero)
F32_TINY = 2.0 ** -126
#: torchao's floor on amax before dividing (``torchao.float8.float8_utils.EPS``)
TORCHAO_EPS = 1e-12


def _fp8_max(fmt: str) -> float:
    try:
        return FP8_MAX[fmt]
    except KeyError:
        raise ValueError(f"unknown float8 format {fmt!r}; accepted: {', '.join(FP8_MAX)}") from None


def _div(a: float, b: float) -> float:
    """IEEE float32 division (x/0 is inf or NaN, as the frameworks' tensors divide)."""
    if b == 0.0:
        return math.nan if a == 0.0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1.0, b)
    return f32(a / b)


def amax_of(values: Iterable[float]) -> float:
    """``max(abs(x))`` of a tensor's values as float32, NaN if any is NaN (as the frameworks' max)."""
    out = 0.0
    for v in values:
        a = abs(v)
        if math.isnan(a):
            return math.nan
        out = a if a > out else out
    return f32(out)


def current_scale(amax: float, fmt: str, margin: int = 0, *, flush_denormals: bool = True) -> float:
    """The multiplier of current scaling for a tensor whose float32 amax is ``amax``.

    ``flush_denormals`` matters only with a margin: the scale of margin 0 is never subnormal
    (``448 / 3.4e38`` is normal), ``scale / 2**margin`` can be, and XLA computes it as 0.
    """
    top = _fp8_max(fmt)
    if math.isnan(amax):
        return math.nan
    scale = f32(top / max(float(amax), TORCHAO_EPS))  # float64 division, rounded to float32 once
    out = f32(scale / 2 ** margin)
    return _flush(out) if flush_denormals else out


@dataclass(frozen=True)
class Fp8ScaleState:
    """One tensor's delayed-scaling state: the float32 ``divisor`` and the amax ``history`` (newest first)."""

    divisor: float
    history: tuple[float, ...]


def delayed_initial(history_length: int, divisor: float = 1.0) -> Fp8ScaleState:
    """The state before the first step: divisor 1 and a zero history, as Keras, Flax and TE start."""
    if not isinstance(history_length, int) or history_length < 1:
        raise ValueError(f"history_length must be an integer >= 1, got {history_length!r}")
    return Fp8ScaleState(f32(divisor), (0.0,) * history_length)


def history_amax(history: Sequence[float], amax_compute: str = "max") -> float:
    """The amax a delayed step scales by: the history's max (NaN wins, as in jnp.max) or its newest entry."""
    if amax_compute == "most_recent":
        return history[0]
    if amax_compute != "max":
        raise ValueError(f"unknown amax_compute {amax_compute!r}; accepted: max, most_recent")
    return math.nan if any(math.isnan(h) for h in history) else max(history)


def _flush(x: float) -> float:
    return math.copysign(0.0, x) if abs(x) < F32_TINY else x


def delayed_step(state: Fp8ScaleState, amax: float, fmt: str, *, margin: int = 0,
                 amax_compute: str = "max", flush_denormals: bool = True) -> Fp8ScaleState:
    """One training step of delayed scaling: ``amax`` is this step's float32 amax of the tensor."""
    top = _fp8_max(fmt)
    ftz = _flush if flush_denormals else (lambda x: x)
    a = ftz(history_amax(state.history, amax_compute))
    if a > 0.0 and math.isfinite(a):
        sf = ftz(_div(ftz(_div(top, a)), 2.0 ** margin))
    else:
        sf = ftz(_div(1.0, ftz(state.divisor)))
    rolled = list(state.history[1:] + state.history[:1])
    rolled[0] = f32(amax)  # stored as computed: the history keeps a subnormal amax
    return Fp8ScaleState(ftz(_div(1.0, sf)), tuple(rolled))


def delayed_trajectory(amaxes: Iterable[float], fmt: str, history_length: int, *, margin: int = 0,
                       amax_compute: str = "max", divisor: float = 1.0,
                       flush_denormals: bool = True) -> list[Fp8ScaleState]:
    """The state after each step of a sequence of per-step amaxes."""
    state, out = delayed_initial(history_length, divisor), []
    for amax in amaxes:
        state = delayed_step(state, amax, fmt, margin=margin, amax_compute=amax_compute,
                             flush_denormals=flush_denormals)
        out.append(state)
    return out
