"""``tune``, framework-free: the pins a run needs, found from a few steps against a float32 reference.

A backend hands :func:`tune_policy` a ``run(policy) -> RunLog`` callable: it trains a *copy* of the
user's model for a few steps under ``policy`` with the backend's own monitor (every step logged,
attribution on) and returns the log (:mod:`ampbridge.diagnostics.runlog`). ``tune_policy`` runs it
once in float32 (the reference), then under the policy; while a run's forward is non-finite (its
loss, or a layer's output: ``first_nonfinite.where == "output"``), or every step's gradients are,
it pins the first layer the monitor names (``keep_float32``, the exact path) and runs again, so the
pins are the fewest this search can find: each one is needed by the run before it, and the last
run, the one ``.policy`` describes, is verified finite. A pinned layer's float32 output may still
not fit the next layer's compute dtype: that layer is then named, and pinned, in the next round
(what the output needs next, no more).

Example:
    >>> from ampbridge.diagnostics.runlog import RunLog
    >>> def run(policy):  # a stand-in backend: layer "big" overflows unless it is pinned
    ...     bad = policy.compute_dtype == "float16" and "big" not in policy.keep_float32
    ...     step = {"step": 0, "loss": float("nan") if bad else 1.0, "loss_scale": 1.0, "found_inf": bad,
    ...             "skipped": bad, "layers": {},
    ...             "first_nonfinite": {"path": "big", "where": "output"} if bad else None}
    ...     return RunLog({"layers": ["small", "big", "head"]}, [step])
    >>> import ampbridge
    >>> result = tune_policy(ampbridge.preset("mixed_float16"), run, framework="example")
    >>> result.policy.keep_float32
    ('big',)
    >>> print(result.diff())
    -keep_float32 = []
    +keep_float32 = ["big"]
"""

from __future__ import annotations

import difflib
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import io as _io
from ..core.dtypes import formats
from ..core.policy import LossScaleConfig, Policy
from .runlog import RunLog

__all__ = ["LayerEvidence", "Candidate", "TuneResult", "tune_policy", "reference_policy", "StepCycle"]

RunFn = Callable[[Policy], RunLog]
Progress = Callable[[str], None]
COMPUTE_DTYPES = ("float16", "bfloat16")


def reference_policy(policy: Policy) -> Policy:
    """The float32 reference: everything in float32, no loss scaling, the same ``[kinds]``."""
    return Policy(compute_dtype="float32", param_dtype="float32", output_dtype="float32",
                  loss_scale=LossScaleConfig(mode="none"), kinds=policy.kinds)


@dataclass(frozen=True)
class LayerEvidence:
    """What the runs showed of one layer (None where the runs gave no comparable number).

    ``nonfinite``: where the monitor named it first non-finite ("output" or "gradient") in the
    run before its pin; ``pinned``: tune added a pin for it; ``underflow``: the largest share of its
    gradients, over the tuned run's steps, that the compute dtype would flush to zero unscaled;
    ``grad_rms_gap``: relative gap of its gradient RMS from the float32 reference at the first
    step both computed finite gradients on the same weights (step 0, or the first steps a
    policy run skipped)."""

    path: str
    nonfinite: str | None = None
    pinned: bool = False
    underflow: float | None = None
    grad_rms_gap: float | None = None


@dataclass(frozen=True)
class Candidate:
    """One compute dtype's outcome: the policy found, the pins added, and how close it came."""

    compute_dtype: str
    policy: Policy
    added: tuple[str, ...]
    finite: bool
    runs: int
    gap_before: float | None  # the first step's loss, relative to the reference's, before tuning (None: non-finite)
    gap_after: float | None  # and with the tuned policy
    skipped: int  # steps the tuned run skipped (the loss scale finding its level)
    evidence: tuple[LayerEvidence, ...]
    problem: str | None = None  # why the search stopped without a finite run

    @property
    def sort_key(self) -> tuple[Any, ...]:
        gap = self.gap_after if self.gap_after is not None else math.inf
        return (not self.finite, len(self.added), gap)


@dataclass(frozen=True)
class TuneResult:
    """What ``tune`` found: ``policy`` (the input policy plus the rules added; dump it with
    ``ampbridge.dump``), :meth:`diff`, ``evidence`` per layer, and each dtype tried (``candidates``)."""

    input_policy: Policy
    policy: Policy
    framework: str
    steps: int
    seconds: float
    candidates: tuple[Candidate, ...]
    chosen: Candidate
    reason: str

    @property
    def added(self) -> tuple[str, ...]:
        return self.chosen.added

    @property
    def finite(self) -> bool:
        return self.chosen.finite

    @property
    def evidence(self) -> dict[str, LayerEvidence]:
        return {e.path: e for e in self.chosen.evidence}

    def diff(self) -> str:
        """The policy-file lines tune changed (``+`` added, ``-`` replaced), TOML as ``ampbridge.dumps`` writes."""
        before = _io.dumps(self.input_policy).splitlines()
        after = _io.dumps(self.policy).splitlines()
        lines = [line for line in difflib.unified_diff(before, after, lineterm="", n=0)
                 if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        return "\n".join(lines)

    def summary(self) -> str:
        return format_result(self)

    def __str__(self) -> str:
        return self.summary()


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _culprit(log: RunLog) -> tuple[str | None, str]:
    """The layer to pin next (or None) and what the run showed: "finite", "output", "gradient", "loss"."""
    forward = [s for s in log.steps if not _finite(s.get("loss"))
               or (s.get("first_nonfinite") or {}).get("where") == "output"]
    for s in forward:
        first = s.get("first_nonfinite") or {}
        if first.get("where") == "output" and first.get("path"):
            return first["path"], "output"
    if forward:
        return None, "loss"
    if log.steps and all(s["skipped"] for s in log.steps):  # the loss scale never found a level
        first = next((s.get("first_nonfinite") for s in log.steps if s.get("first_nonfinite")), None) or {}
        return (first.get("path") or None), "gradient"
    return None, "finite"


def _loss_gap(run: RunLog, reference: RunLog) -> float | None:
    """Relative gap of the first step's loss from the reference's: the same weights and the same
    batch, so only the forward's numerics differ (later steps also differ by the skipped updates)."""
    if not run.steps or not reference.steps or run.steps[0]["step"] != reference.steps[0]["step"]:
        return None
    a, b = run.steps[0].get("loss"), reference.steps[0].get("loss")
    if not (_finite(a) and _finite(b)):
        return None
    return abs(a - b) / max(abs(b), 1e-12)


def _rms_gaps(run: RunLog, reference: RunLog) -> dict[str, float]:
    """Per layer: relative gap of the gradient RMS at the first finite step whose weights equal the
    reference's step 0 (no update applied before it); batches differ after step 0, so only then."""
    if not reference.steps or not run.steps:
        return {}
    ref0 = reference.steps[0]
    for s in run.steps:
        if not s["skipped"]:
            if s["step"] != ref0["step"]:
                return {}  # a different batch from the reference's step 0
            out = {}
            for path, stats in s.get("layers", {}).items():
                a, b = stats.get("grad_rms"), ref0.get("layers", {}).get(path, {}).get("grad_rms")
                if _finite(a) and _finite(b) and b > 0:
                    out[path] = abs(a - b) / b
            return out
    return {}


def _evidence(first_log: RunLog, final: RunLog, reference: RunLog, added: Sequence[str],
              named: Mapping[str, str]) -> tuple[LayerEvidence, ...]:
    order = list(reference.header.get("layers") or first_log.header.get("layers") or [])
    for p in list(named) + list(added):
        if p not in order:
            order.append(p)
    under: dict[str, float] = {}
    for s in final.steps:
        for path, stats in s.get("layers", {}).items():
            u = stats.get("underflow")
            if _finite(u):
                under[path] = max(under.get(path, 0.0), u)
    gaps = _rms_gaps(final, reference)
    return tuple(LayerEvidence(p, named.get(p), p in added, under.get(p), gaps.get(p)) for p in order)


def _search(policy: Policy, run: RunFn, reference: RunLog, progress: Progress | None,
            max_rounds: int) -> Candidate:
    """Pin the first layer named non-finite, re-run, until the run is finite (or nothing is left to pin)."""
    added: list[str] = []
    named: dict[str, str] = {}
    current = policy
    first_log = log = run(current)
    gap_before = _loss_gap(first_log, reference)
    problem = None
    for rounds in range(1, max_rounds + 1):
        path, what = _culprit(log)
        if what == "finite":
            break
        if path is None:
            problem = ("the loss itself is non-finite with every layer's output finite" if what == "loss" else
                       "every step's gradients are non-finite and the monitor names no layer")
            break
        if path in added or path in current.keep_float32:
            problem = f"{path!r} is pinned to float32 and still goes non-finite ({what})"
            break
        named.setdefault(path, what)
        added.append(path)
        current = current.replace(keep_float32=current.keep_float32 + (path,))
        if progress is not None:
            progress(f"{policy.compute_dtype}: {path!r} went non-finite ({what}); pinned, re-running")
        log = run(current)  # the verification: the next round reads this run
    else:
        if _culprit(log)[1] != "finite":
            problem = f"still non-finite after {max_rounds} pins"
    finite = _culprit(log)[1] == "finite"
    return Candidate(policy.compute_dtype, current, tuple(added), finite, len(added) + 1, gap_before,
                     _loss_gap(log, reference), sum(1 for s in log.steps if s["skipped"]),
                     _evidence(first_log, log, reference, added, named), None if finite else problem)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.3g}%"


def _describe(c: Candidate) -> str:
    if not c.finite:
        return f"{c.compute_dtype}: no finite run ({c.problem})"
    pins = f"{len(c.added)} pin(s)" if c.added else "no pins"
    return f"{c.compute_dtype}: finite with {pins}, loss {_pct(c.gap_after)} from the float32 reference"


def _choose(candidates: Sequence[Candidate]) -> tuple[Candidate, str]:
    best = min(candidates, key=lambda c: c.sort_key)
    if len(candidates) == 1:
        return best, _describe(best)
    others = [c for c in candidates if c is not best]
    why = ("it is the only one that runs finite" if best.finite and not any(c.finite for c in others) else
           "no dtype runs finite; it gets furthest" if not best.finite else
           "it needs fewer pins (more of the model stays 16-bit)"
           if any(len(c.added) > len(best.added) for c in others if c.finite) else
           "it is closer to the float32 reference with as few pins")
    return best, f"{best.compute_dtype} is better: {why}. " + "; ".join(_describe(c) for c in candidates)


def tune_policy(policy: Policy, run: RunFn, *, dtypes: Iterable[str] | None = None,
                framework: str = "", steps: int = 0, progress: Progress | None = None,
                max_rounds: int = 32) -> TuneResult:
    """Search the fewest pins for ``policy`` with the backend's ``run`` (see the module docstring).

    ``dtypes``: the compute dtypes to consider (default: the policy's own); with several, the
    result keeps the best (finite first, then fewer pins, then the smaller gap from float32)."""
    start = time.perf_counter()
    if not isinstance(policy, Policy):  # the backends resolve names and files (backends.common.as_policy)
        raise TypeError(f"tune_policy takes a Policy; received {type(policy).__name__}")
    if policy.phases:
        raise ValueError("tune takes a policy without [[phase]] entries; tune each phase's policy "
                         "(policy.at(step=...)) on its own")
    wanted = tuple(dtypes) if dtypes is not None else (policy.compute_dtype,)
    known = set(formats())
    for d in wanted:
        if d not in COMPUTE_DTYPES and d != policy.compute_dtype:
            raise ValueError(f"dtypes: {d!r} is not a compute dtype tune considers; accepted: "
                             f"{', '.join(COMPUTE_DTYPES)}" + ("" if d in known else " (not a known dtype)"))
    if not wanted:
        raise ValueError("dtypes: name at least one compute dtype (float16, bfloat16)")
    if progress is not None:
        progress("float32 reference run")
    reference = run(reference_policy(policy))
    candidates = []
    for d in dict.fromkeys(wanted):
        base = policy if d == policy.compute_dtype else policy.replace(compute_dtype=d)
        if progress is not None:
            progress(f"{d}: policy run")
        candidates.append(_search(base, run, reference, progress, max_rounds))
    chosen, reason = _choose(candidates)
    return TuneResult(policy, chosen.policy, framework, steps, time.perf_counter() - start, tuple(candidates),
                      chosen, reason)


def format_result(result: TuneResult) -> str:
    """The printable summary: what was added and why, the gap from float32, the evidence per layer."""
    c = result.chosen
    lines = [f"tune ({result.framework or 'backend'}): {result.steps} step(s) per run, "
             f"{sum(x.runs for x in result.candidates) + 1} run(s), {result.seconds:.1f} s",
             result.reason]
    if not c.finite:
        lines.append(f"not finite: {c.problem}; the policy below is the last one tried")
    gap = {k: "non-finite" if v is None else _pct(v) for k, v in (("before", c.gap_before), ("after", c.gap_after))}
    lines.append(f"first-step loss gap from the float32 reference: before {gap['before']}, after {gap['after']}"
                 f"; the tuned run skipped {c.skipped} step(s)")
    diff = result.diff()
    lines += ["added to the policy:", *(f"  {line}" for line in diff.splitlines())] if diff else [
        "nothing to add: the policy runs finite as it is"]
    rows = [e for e in c.evidence if e.nonfinite or e.pinned or (e.underflow or 0) > 0
            or (e.grad_rms_gap or 0) > 0.01]
    if rows:
        lines.append("evidence (layer: where it went non-finite before its pin, pinned, gradient underflow share, "
                     "gradient RMS gap from float32):")
        for e in rows:
            lines.append(f"  {e.path}: {e.nonfinite or '-'}, {'pinned' if e.pinned else '-'}, "
                         f"{_pct(e.underflow)}, {_pct(e.grad_rms_gap)}")
    return "\n".join(lines)


@dataclass
class StepCycle:
    """The first ``steps`` batches of ``data``, cycled when it holds fewer (every run sees the same)."""

    steps: int
    batches: list[Any] = field(default_factory=list)

    @classmethod
    def of(cls, data: Iterable[Any], steps: int) -> "StepCycle":
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1; received {steps!r}")
        taken = []
        for batch in data:
            taken.append(batch)
            if len(taken) == steps:
                break
        if not taken:
            raise ValueError("tune needs at least one batch; the data gave none")
        return cls(steps, [taken[i % len(taken)] for i in range(steps)])
