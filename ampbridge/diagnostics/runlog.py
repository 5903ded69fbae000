"""The numerics log: one JSON Lines format every backend's monitor writes.

The first line describes the run; each further line is one monitored step::

    {"kind": "run", "version": 1, "framework": "torch", "compute_dtype": "float16",
     "policy": {...}, "layers": ["embed", "block.norm1", ...], "min_scale": 1.0}
    {"kind": "step", "step": 12, "loss": 2.31, "loss_scale": 65536.0, "found_inf": false,
     "skipped": false, "first_nonfinite": null,
     "layers": {"block.attn.query": {"grad_max_abs": ..., "grad_rms": ..., "zero": ...,
                                     "nonfinite": ..., "underflow": ..., "overflow": ...}}}

(``loss_scale``: the scale the step used, so a skipped step's backoff shows in the next step's),
and the monitor, when it closes, writes a closing record with what it saw::

    {"kind": "end", "steps": 60, "skipped": 2, "first_step": 0, "last_step": 59}

``steps`` counts every optimizer step the monitor saw (logged or not: a sampling monitor logs
every N-th step and every non-finite one), ``skipped`` those whose update was skipped (all of
them are in the log), ``first_step`` / ``last_step`` the step counter's first and last value it
saw (null when it saw none). A log may hold several closing records (a Keras ``fit`` writes one
when it ends, and a later ``fit`` appends more steps): each gives the totals so far, the last
one counts. A log without one (the monitor was never closed, or an older ampbridge wrote it) still
reads: ``ampbridge report`` then counts the steps up to the last logged one, and says so.

``layers`` in the run line lists Plan paths in forward order (overflow attribution names the
first of them that went non-finite). Per-layer statistics cover the gradients of the parameters
the layer owns, taken before unscaling (``g``, scaled by ``S = loss_scale``):

- ``grad_max_abs``, ``grad_rms``: of the finite unscaled gradients ``g / S``
- ``zero``: fraction with ``g == 0``; ``nonfinite``: fraction inf or nan
- ``underflow``: fraction finite, non-zero once unscaled, yet below the compute dtype's smallest
  subnormal: they would flush to zero without loss scaling
- ``overflow``: fraction finite yet beyond the compute dtype's max: scaled this much, they would
  overflow in the compute dtype

:func:`layer_stats` is the reference definition (numpy), which the backends' own reductions
are tested against. ``first_nonfinite`` is ``{"path": ..., "where": "output" | "gradient"}``.

A step record of a run with float8 layers (``[fp8]``) may carry ``fp8``: per float8 layer, per
float8 tensor (``input``, ``weight``, ``grad_output``) what :class:`Fp8TensorStats` holds::

    "fp8": {"dense": {"input": {"amax": 900.0, "scale": 0.0223, "scale_op": "divide", "fp8_max": 448.0,
                                "compute_dtype": "bfloat16", "scaled_amax": 40320.0, "saturated": true,
                                "saturated_fraction": null}}}

``amax``: the tensor's max-abs value on this step; ``scale``: the scale the step quantized it with,
as the framework keeps it (``scale_op`` ``divide``: the float8 value is ``x / scale``, Keras, Flax
and delayed scaling; ``multiply``: ``x * scale``, torchao); ``saturated``: values went beyond the
format's max after scaling and were clipped to it (``amax`` scaled as the framework scales, in
``compute_dtype``: ``scaled_amax``, beyond ``fp8_max``; or a non-finite ``amax``: a bfloat16 layer's
steady amax over the divisor made from it can land one bfloat16 step, 450, above 448); ``saturated_fraction``: the fraction of values clipped, where the
monitor could count it cheaply (null where not).

Example:
    >>> import numpy as np
    >>> s = layer_stats(np.array([0.0, 1e-9, 4.0, np.inf]), loss_scale=1.0, compute_dtype="float16")
    >>> (s["zero"], s["underflow"], s["nonfinite"])
    (0.25, 0.25, 0.25)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..core.dtypes import formats

LOG_VERSION = 1
STAT_KEYS = ("grad_max_abs", "grad_rms", "zero", "nonfinite", "underflow", "overflow")
#: the float8 tensors of a layer's matmul, in record order
FP8_TENSORS = ("input", "weight", "grad_output")


def _round(x: float, dtype: str = "float32") -> float:
    """``x`` rounded to nearest-even in ``dtype`` (float32, bfloat16 or float16); beyond its range, inf.
    A quotient of two such values rounded through float32 is still the correctly rounded one."""
    import struct

    if math.isnan(x) or math.isinf(x):
        return x
    try:
        x = struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)
    if dtype == "float16":
        try:
            return struct.unpack("e", struct.pack("e", x))[0]
        except OverflowError:
            return math.copysign(math.inf, x)
    if dtype == "bfloat16":
        bits = struct.unpack("I", struct.pack("f", x))[0]
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # round to nearest even on the top 16 bits
        return struct.unpack("f", struct.pack("I", bits & 0xFFFFFFFF))[0]
    return x


@dataclass(frozen=True)
class Fp8TensorStats:
    """One float8 tensor of one layer on one step: its amax, the scale the step used, saturation.

    Example:
        >>> s = Fp8TensorStats(amax=900.0, scale=1.0, scale_op="divide", fp8_max=448.0)
        >>> s.saturated, Fp8TensorStats(1.0, 448.0, "multiply", 448.0).saturated
        (True, False)
    """

    amax: float  # this step's max |x| of the tensor, before scaling
    scale: float  # the scale that quantized it, as the framework keeps it (see scale_op)
    scale_op: str  # "divide": float8 value = x / scale (Keras, Flax); "multiply": x * scale (torchao)
    fp8_max: float  # the format's largest finite value (448 e4m3, 57344 e5m2)
    saturated_fraction: float | None = None  # fraction of values clipped, where counted
    compute_dtype: str = "float32"  # the dtype the framework scales in (Keras, Flax: the layer's compute dtype)

    def __post_init__(self) -> None:
        if self.scale_op not in ("divide", "multiply"):
            raise ValueError(f"Fp8TensorStats: scale_op must be 'divide' or 'multiply'; received {self.scale_op!r}")
        if self.compute_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"Fp8TensorStats: compute_dtype must be float32, bfloat16 or float16; received "
                             f"{self.compute_dtype!r}")

    @property
    def scaled_amax(self) -> float:
        """The amax after scaling, computed as the framework does: operands and result rounded to
        ``compute_dtype`` (Keras and Flax divide in the layer's compute dtype, so a bfloat16 layer's
        amax scaled by a divisor made from that same amax can land a rounding step above fp8_max)."""
        dtype = self.compute_dtype
        amax, scale = _round(float(self.amax), dtype), _round(float(self.scale), dtype)
        if self.scale_op == "multiply":
            return _round(amax * scale, dtype) if not (amax == 0 and math.isinf(scale)) else math.nan
        if scale == 0:
            return math.inf if amax > 0 else math.nan  # x / 0: inf, clipped to fp8_max; 0 / 0: NaN
        return _round(amax / scale, dtype)

    @property
    def saturated(self) -> bool:
        """Values beyond ``fp8_max`` after scaling (clipped to it), or a non-finite amax (inf clips;
        NaN has no float8 value)."""
        if self.saturated_fraction is not None and self.saturated_fraction > 0:
            return True
        return not math.isfinite(self.amax) or self.scaled_amax > self.fp8_max

    def to_record(self) -> dict[str, Any]:
        return {"amax": float(self.amax), "scale": float(self.scale), "scale_op": self.scale_op,
                "fp8_max": float(self.fp8_max), "compute_dtype": self.compute_dtype,
                "scaled_amax": float(self.scaled_amax), "saturated": self.saturated,
                "saturated_fraction": None if self.saturated_fraction is None else float(self.saturated_fraction)}


def layer_stats(grad: Any, loss_scale: float, compute_dtype: str) -> dict[str, float]:
    """The reference per-layer statistics of one (scaled) gradient array, computed with numpy."""
    import numpy as np

    fmt = formats()[compute_dtype]
    g = np.asarray(grad, dtype=np.float64).ravel()
    n = max(g.size, 1)
    finite = np.isfinite(g)
    u = g[finite] / float(loss_scale)
    nonzero = u != 0
    return {
        "grad_max_abs": float(np.max(np.abs(u))) if u.size else float("nan"),
        "grad_rms": float(np.sqrt(np.mean(u * u))) if u.size else float("nan"),
        "zero": float(np.count_nonzero(g == 0) / n),
        "nonfinite": float(np.count_nonzero(~finite) / n),
        "underflow": float(np.count_nonzero(nonzero & (np.abs(u) < fmt.smallest_subnormal)) / n),
        "overflow": float(np.count_nonzero(np.abs(g[finite]) > fmt.max) / n),
    }


def _json_number(x: Any) -> Any:
    if isinstance(x, float) and x != x:
        return None  # NaN is not JSON; null reads back as "no value"
    if isinstance(x, float) and x in (float("inf"), float("-inf")):
        return "inf" if x > 0 else "-inf"
    return x


def _clean(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return _json_number(obj)


class RunLogWriter:
    """Append-only writer of a run log; one line per record, flushed as written.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> with RunLogWriter(path, framework="torch", compute_dtype="float16", layers=["a"]) as log:
        ...     log.step(0, loss=1.0, loss_scale=2.0, found_inf=False, skipped=False)
        >>> read_log(path).steps[0]["loss_scale"]
        2.0
    """

    def __init__(self, path: str | os.PathLike[str], *, framework: str, compute_dtype: str,
                 layers: Iterable[str], policy: Mapping[str, Any] | None = None,
                 min_scale: float | None = None, extra: Mapping[str, Any] | None = None):
        self.path = Path(path)
        self._file: IO[str] = self.path.open("w", encoding="utf-8")
        self.skipped = 0  # step records written with skipped = true
        header = {"kind": "run", "version": LOG_VERSION, "framework": framework,
                  "compute_dtype": compute_dtype, "policy": dict(policy or {}), "layers": list(layers),
                  "min_scale": min_scale, **(extra or {})}
        self._write(header)

    def _write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(_clean(record)) + "\n")
        self._file.flush()

    def step(self, step: int, *, loss: float | None, loss_scale: float, found_inf: bool, skipped: bool,
             layers: Mapping[str, Mapping[str, float]] | None = None,
             first_nonfinite: Mapping[str, str] | None = None,
             fp8: Mapping[str, Mapping[str, Fp8TensorStats]] | None = None) -> None:
        """One step record; ``fp8``: per float8 layer, per tensor (``FP8_TENSORS``), its statistics."""
        record = {"kind": "step", "step": int(step), "loss": None if loss is None else float(loss),
                  "loss_scale": float(loss_scale), "found_inf": bool(found_inf), "skipped": bool(skipped),
                  "first_nonfinite": dict(first_nonfinite) if first_nonfinite else None,
                  "layers": {k: {s: float(v[s]) for s in STAT_KEYS if s in v} for k, v in (layers or {}).items()}}
        if fp8:
            record["fp8"] = {path: {t: tensors[t].to_record() for t in FP8_TENSORS if t in tensors}
                             for path, tensors in fp8.items()}
        self._write(record)
        self.skipped += bool(skipped)

    def end(self, steps: int, *, first_step: int | None, last_step: int | None, skipped: int | None = None) -> None:
        """The closing record: ``steps`` the monitor saw, ``skipped`` of them (default: the skipped
        step records written), the first and last step number it saw."""
        self._write({"kind": "end", "steps": int(steps), "skipped": int(self.skipped if skipped is None else skipped),
                     "first_step": None if first_step is None else int(first_step),
                     "last_step": None if last_step is None else int(last_step)})

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "RunLogWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class RunLog:
    header: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    source: str = ""
    end: dict[str, Any] | None = None  # the last closing record; None in a log without one
    problem: str | None = None  # read_log(partial=True): what is wrong where the good part ends


def _number(v: Any) -> Any:
    if v == "inf":
        return float("inf")
    if v == "-inf":
        return float("-inf")
    if v is None:
        return float("nan")
    return v


def _check_step(record: dict[str, Any]) -> str | None:
    """What is wrong with a step record's fields, or None."""
    for key in ("step", "loss_scale", "found_inf", "skipped"):
        if key not in record:
            return f"step record without {key!r}"
    if not isinstance(record["step"], int) or isinstance(record["step"], bool) or record["step"] < 0:
        return f"'step' must be an integer >= 0; received {record['step']!r}"
    if not _is_number(_number(record["loss_scale"])):
        return f"'loss_scale' must be a number; received {record['loss_scale']!r}"
    for key in ("found_inf", "skipped"):
        if not isinstance(record[key], bool):
            return f"{key!r} must be true or false; received {record[key]!r}"
    if not _is_number(_number(record.get("loss"))):
        return f"'loss' must be a number or null; received {record.get('loss')!r}"
    first = record.get("first_nonfinite")
    if first is not None and not (isinstance(first, dict) and isinstance(first.get("path"), str)
                                  and isinstance(first.get("where"), str)):
        return f"'first_nonfinite' must be null or {{\"path\": ..., \"where\": ...}}; received {first!r}"
    layers = record.get("layers", {})
    if not isinstance(layers, dict) or not all(
            isinstance(stats, dict) and all(_is_number(_number(v)) for v in stats.values()) for stats in layers.values()):
        return "'layers' must map each layer to its numeric statistics"
    return _check_fp8(record.get("fp8", {}))


def _check_fp8(fp8: Any) -> str | None:
    """What is wrong with a step record's ``fp8`` field, or None."""
    shape = ("'fp8' must map each float8 layer to its tensors (input, weight, grad_output), each "
             "{amax, scale, scale_op, fp8_max, compute_dtype, scaled_amax, saturated, saturated_fraction}")
    if not isinstance(fp8, dict) or not all(isinstance(t, dict) for t in fp8.values()):
        return shape
    for path, tensors in fp8.items():
        for name, stats in tensors.items():
            if name not in FP8_TENSORS or not isinstance(stats, dict):
                return f"{shape}; received {path!r}: {name!r}"
            numbers = [stats.get(k) for k in ("amax", "scale", "fp8_max")] + [stats.get("scaled_amax", 0.0)]
            fraction = stats.get("saturated_fraction")
            if (not all(_is_number(_number(v)) for v in numbers) or not isinstance(stats.get("saturated"), bool)
                    or stats.get("scale_op") not in ("divide", "multiply")
                    or stats.get("compute_dtype", "float32") not in ("float32", "bfloat16", "float16")
                    or not (fraction is None or _is_number(fraction))):
                return f"{shape}; received {path!r}: {name!r}: {stats!r}"
    return None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_end(record: dict[str, Any], steps: list[dict[str, Any]]) -> str | None:
    for key in ("steps", "skipped"):
        value = record.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"end record: {key!r} must be an integer >= 0; received {value!r}"
    for key in ("first_step", "last_step"):
        value = record.setdefault(key, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return f"end record: {key!r} must be an integer or null; received {value!r}"
    last = record["last_step"]
    beyond = [s["step"] for s in steps if last is not None and s["step"] > last]
    if beyond:
        return f"end record: last_step {last} but step {beyond[0]} was logged before it"
    return None


def read_log(path: str | os.PathLike[str], *, partial: bool = False) -> RunLog:
    """Read a run log, checking its shape; raises ValueError naming the file and line.

    ``partial=True`` (``ampbridge report``): a bad record after the header (a line cut by a killed
    run, a field of the wrong type, a closing record the steps before it contradict) ends the read
    there instead; the log holds every record before it and ``problem`` says what is wrong, in one line.
    """
    source = str(path)
    lines: Iterator[str] = iter(Path(path).read_text(encoding="utf-8-sig").splitlines())
    log: RunLog | None = None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            wrong = f"{source}:{number}: not JSON: {e.msg}"
            if log is None or not partial:
                raise ValueError(wrong) from None
            log.problem = f"{wrong} (a line cut short?); read up to line {number - 1}"
            break
        kind = record.get("kind") if isinstance(record, dict) else None
        if log is None:
            if kind != "run":
                raise ValueError(f"{source}:{number}: the first record must be the run header (kind 'run')")
            if record.get("version") != LOG_VERSION:
                raise ValueError(f"{source}:{number}: log version {record.get('version')!r}; accepted: {LOG_VERSION}")
            log = RunLog(record, source=source)
            continue
        if kind == "end":
            wrong = _check_end(record, log.steps)
        elif kind == "step":
            wrong = _check_step(record)
        else:
            wrong = f"unknown record kind {kind!r}; accepted: step, end"
        if wrong:
            if not partial:
                raise ValueError(f"{source}:{number}: {wrong}")
            log.problem = f"{source}:{number}: {wrong}; read up to line {number - 1}"
            break
        if kind == "end":
            log.end = record
            continue
        record["loss"] = _number(record.get("loss"))
        for stats in record.get("layers", {}).values():
            for k in list(stats):
                stats[k] = _number(stats[k])
        for tensors in record.get("fp8", {}).values():
            for stats in tensors.values():
                for k in ("amax", "scale", "fp8_max", "scaled_amax"):
                    if k in stats:
                        stats[k] = _number(stats[k])
        log.steps.append(record)
    if log is None:
        raise ValueError(f"{source}: empty log")
    return log
