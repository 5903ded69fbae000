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

Then, while the finite run's loss gap from the reference (:func:`loss_gap`: the mean absolute loss
difference over the steps, relative to the reference's mean absolute loss) is over ``tolerance``
(default :data:`TOLERANCE`, 5%), it ranks the unpinned layers by their divergence from the reference
(:func:`divergence`: the largest of the gradient RMS gap on step 0, the share of gradients flushed to
zero that the reference has non-zero, and the underflow share), pins the highest, re-runs, and keeps
the pin when it lowers the gap by at least a tenth; a pin that does not is undone and the next ranked
layer is tried (``tries`` per round, default 3). When none helps the search stops and ``.reason`` says so.

A policy with ``[[phase]]`` entries is tuned in the phase in force over steps 0 .. ``steps``-1 (the runs
get that phase's complete policy, no schedule) and the pins go into that phase; steps that cross a
phase bound are refused.

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

import dataclasses
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

__all__ = ["LayerEvidence", "Candidate", "TuneResult", "tune_policy", "reference_policy", "StepCycle", "loss_gap",
           "divergence", "TOLERANCE"]

RunFn = Callable[[Policy], RunLog]
Progress = Callable[[str], None]
COMPUTE_DTYPES = ("float16", "bfloat16")
#: the default ``tolerance``: the loss gap from the float32 reference (:func:`loss_gap`) tune accepts
TOLERANCE = 0.05
#: a divergence pin is kept only when the gap it leaves is below this share of the gap before it
HELPS = 0.9


def reference_policy(policy: Policy) -> Policy:
    """The float32 reference: everything in float32, no loss scaling, the same ``[kinds]``."""
    return Policy(compute_dtype="float32", param_dtype="float32", output_dtype="float32",
                  loss_scale=LossScaleConfig(mode="none"), kinds=policy.kinds)


@dataclass(frozen=True)
class LayerEvidence:
    """What the runs showed of one layer (None where the runs gave no comparable number).

    ``nonfinite``: where the monitor named it first non-finite ("output" or "gradient") in the
    run before its pin; ``pinned``: tune added a pin for it (``diverged``: for the loss gap, not for a
    non-finite value); ``underflow``: the largest share of its gradients, over the tuned run's steps,
    that the compute dtype would flush to zero unscaled; ``flushed``: the largest share, over the steps,
    of its gradients that are zero in the tuned run beyond the reference's zero share; ``grad_rms_gap``:
    relative gap of its gradient RMS from the float32 reference at the first step both computed finite
    gradients on the same weights (step 0, or the first steps a policy run skipped)."""

    path: str
    nonfinite: str | None = None
    pinned: bool = False
    underflow: float | None = None
    grad_rms_gap: float | None = None
    flushed: float | None = None
    diverged: bool = False


@dataclass(frozen=True)
class Candidate:
    """One compute dtype's outcome: the policy found, the pins added, and how close it came."""

    compute_dtype: str
    policy: Policy
    added: tuple[str, ...]
    finite: bool
    runs: int
    gap_before: float | None  # loss_gap of the policy as given (None: non-finite)
    gap_after: float | None  # and of the tuned policy
    skipped: int  # steps the tuned run skipped (the loss scale finding its level)
    evidence: tuple[LayerEvidence, ...]
    problem: str | None = None  # why the search stopped without a finite run
    tolerance: float = TOLERANCE
    note: str | None = None  # why the divergence search stopped over the tolerance

    @property
    def close(self) -> bool:
        """Finite and within ``tolerance`` of the float32 reference."""
        return self.finite and self.gap_after is not None and self.gap_after <= self.tolerance

    @property
    def sort_key(self) -> tuple[Any, ...]:
        gap = self.gap_after if self.gap_after is not None else math.inf
        return (not self.finite, not self.close, len(self.added), gap)


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


def loss_gap(run: RunLog, reference: RunLog) -> float | None:
    """The run's divergence from the float32 reference: the mean over the steps both logged of
    ``|loss - reference loss|``, over the mean of ``|reference loss|`` (the same batches in the same
    order; a skipped step counts, as the update the reference made and the run did not). None when a
    loss is non-finite or no step is in both.

    >>> from ampbridge.diagnostics.runlog import RunLog
    >>> log = lambda losses: RunLog({}, [{"step": i, "loss": x} for i, x in enumerate(losses)])
    >>> loss_gap(log([1.1, 0.9]), log([1.0, 1.0]))
    0.1
    """
    ref = {s["step"]: s.get("loss") for s in reference.steps}
    pairs = [(s.get("loss"), ref[s["step"]]) for s in run.steps if s["step"] in ref]
    if not pairs or not all(_finite(a) and _finite(b) for a, b in pairs):
        return None
    scale = sum(abs(b) for _, b in pairs) / len(pairs)
    return round(sum(abs(a - b) for a, b in pairs) / len(pairs) / max(scale, 1e-12), 12)


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


def _flushed(run: RunLog, reference: RunLog) -> dict[str, float]:
    """Per layer: the largest share, over the steps both logged, of gradients zero in the run beyond
    the reference's zero share at that step (values the compute dtype flushed to zero)."""
    ref = {s["step"]: s.get("layers", {}) for s in reference.steps}
    out: dict[str, float] = {}
    for s in run.steps:
        if s["skipped"] or s["step"] not in ref:
            continue
        for path, stats in s.get("layers", {}).items():
            a, b = stats.get("zero"), ref[s["step"]].get(path, {}).get("zero")
            if _finite(a) and _finite(b):
                out[path] = max(out.get(path, 0.0), a - b)
    return out


def _underflow(run: RunLog) -> dict[str, float]:
    under: dict[str, float] = {}
    for s in run.steps:
        for path, stats in s.get("layers", {}).items():
            u = stats.get("underflow")
            if _finite(u):
                under[path] = max(under.get(path, 0.0), u)
    return under


def divergence(run: RunLog, reference: RunLog) -> dict[str, float]:
    """Per layer with gradient statistics in both runs: the score tune ranks divergence pins by, the
    largest of its gradient RMS gap on step 0, its flushed share and its underflow share (0 to ~1)."""
    parts = (_rms_gaps(run, reference), _flushed(run, reference), _underflow(run))
    paths = dict.fromkeys(p for part in parts for p in part)
    return {p: max(part.get(p, 0.0) for part in parts) for p in paths}


def _evidence(first_log: RunLog, final: RunLog, reference: RunLog, added: Sequence[str],
              named: Mapping[str, str]) -> tuple[LayerEvidence, ...]:
    order = list(reference.header.get("layers") or first_log.header.get("layers") or [])
    for p in list(named) + list(added):
        if p not in order:
            order.append(p)
    under, gaps, flushed = _underflow(final), _rms_gaps(final, reference), _flushed(final, reference)
    return tuple(LayerEvidence(p, named.get(p), p in added, under.get(p), gaps.get(p), flushed.get(p),
                               p in added and p not in named) for p in order)


def _make_finite(current: Policy, log: RunLog, run: RunFn, progress: Progress | None, max_rounds: int,
                 added: list[str], named: dict[str, str]) -> tuple[Policy, RunLog, int, str | None]:
    """Pin the first layer named non-finite, re-run, until the run is finite (or nothing is left to pin)."""
    runs = 0
    for _ in range(max_rounds):
        path, what = _culprit(log)
        if what == "finite":
            return current, log, runs, None
        if path is None:
            return current, log, runs, ("the loss itself is non-finite with every layer's output finite"
                                        if what == "loss" else
                                        "every step's gradients are non-finite and the monitor names no layer")
        if path in current.keep_float32:
            return current, log, runs, f"{path!r} is pinned to float32 and still goes non-finite ({what})"
        named.setdefault(path, what)
        added.append(path)
        current = current.replace(keep_float32=current.keep_float32 + (path,))
        if progress is not None:
            progress(f"{current.compute_dtype}: {path!r} went non-finite ({what}); pinned, re-running")
        log, runs = run(current), runs + 1  # the verification: the next round reads this run
    finite = _culprit(log)[1] == "finite"
    return current, log, runs, None if finite else f"still non-finite after {max_rounds} pins"


def _ranked(scores: Mapping[str, float], pinned: Sequence[str], order: Sequence[str], tries: int) -> list[str]:
    """The layers to try, ``tries`` at most: by divergence, the most divergent first, alternating with
    the forward order (a forward error's origin is upstream of the layers whose inputs it corrupts,
    and their gradients can differ more than its own)."""
    open_ = [p for p in scores if p not in pinned and scores[p] > 0]
    by_score = sorted(open_, key=lambda p: -scores[p])
    position = {p: i for i, p in enumerate(order)}
    by_order = sorted(open_, key=lambda p: position.get(p, len(position)))
    mixed = [p for pair in zip(by_score, by_order) for p in pair]
    return list(dict.fromkeys(mixed))[:tries]


def _converge(current: Policy, log: RunLog, reference: RunLog, run: RunFn, progress: Progress | None,
              tolerance: float, tries: int, max_rounds: int, added: list[str]) -> tuple[Policy, RunLog, int, str | None]:
    """While the finite run's loss gap is over ``tolerance``: pin the most divergent layer, keep the pin
    when the re-run is finite and its gap below ``HELPS`` times the gap before; else try the next."""
    runs = 0
    gap = loss_gap(log, reference)
    for _ in range(max_rounds):
        if gap is None or gap <= tolerance:
            return current, log, runs, None
        scores = divergence(log, reference)
        ranked = _ranked(scores, current.keep_float32, log.header.get("layers") or [], tries)
        if not ranked:
            return current, log, runs, (f"the loss gap {_pct(gap)} is over the tolerance {_pct(tolerance)} "
                                        "and no unpinned layer's gradients differ from the reference's")
        for path in ranked:
            trial = current.replace(keep_float32=current.keep_float32 + (path,))
            if progress is not None:
                progress(f"{current.compute_dtype}: loss gap {_pct(gap)}; trying a pin on {path!r} "
                         f"(divergence {_pct(scores[path])})")
            trial_log, runs = run(trial), runs + 1
            trial_gap = loss_gap(trial_log, reference)
            if _culprit(trial_log)[1] == "finite" and trial_gap is not None and trial_gap < HELPS * gap:
                current, log, gap = trial, trial_log, trial_gap
                added.append(path)
                break
        else:
            tried = ", ".join(repr(p) for p in ranked)
            return current, log, runs, (f"the loss gap {_pct(gap)} is over the tolerance {_pct(tolerance)}; "
                                        f"a pin on {tried} did not lower it (the gap may come from a layer "
                                        "without gradients, or from skipped steps)")
    return current, log, runs, f"the loss gap {_pct(gap)} is still over the tolerance after {max_rounds} pins"


def _search(policy: Policy, run: RunFn, reference: RunLog, progress: Progress | None, max_rounds: int,
            tolerance: float = TOLERANCE, tries: int = 3) -> Candidate:
    """The non-finite pins first (:func:`_make_finite`), then the divergence pins (:func:`_converge`)."""
    added: list[str] = []
    named: dict[str, str] = {}
    first_log = run(policy)
    current, log, runs, problem = _make_finite(policy, first_log, run, progress, max_rounds, added, named)
    note = None
    if problem is None and tries > 0:
        current, log, more, note = _converge(current, log, reference, run, progress, tolerance, tries,
                                             max_rounds, added)
        runs += more
    finite = _culprit(log)[1] == "finite"
    skipped = sum(1 for s in log.steps if s["skipped"])
    if note and skipped:
        note += (f"; the run skipped {skipped} of {len(log.steps)} step(s) (the loss scale backing off): the "
                 "updates the reference made on them are part of the gap, which no pin removes")
    return Candidate(policy.compute_dtype, current, tuple(added), finite, runs + 1, loss_gap(first_log, reference),
                     loss_gap(log, reference), skipped, _evidence(first_log, log, reference, added, named),
                     None if finite else problem, tolerance, note)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.3g}%"


def _describe(c: Candidate) -> str:
    if not c.finite:
        return f"{c.compute_dtype}: no finite run ({c.problem})"
    pins = f"{len(c.added)} pin(s)" if c.added else "no pins"
    within = "within" if c.close else "over"
    text = (f"{c.compute_dtype}: finite with {pins}, loss gap {_pct(c.gap_after)} from the float32 reference "
            f"({within} the tolerance {_pct(c.tolerance)})")
    return text + (f"; {c.note}" if c.note else "")


def _choose(candidates: Sequence[Candidate]) -> tuple[Candidate, str]:
    best = min(candidates, key=lambda c: c.sort_key)
    if len(candidates) == 1:
        return best, _describe(best)
    others = [c for c in candidates if c is not best]
    why = ("it is the only one that runs finite" if best.finite and not any(c.finite for c in others) else
           "no dtype runs finite; it gets furthest" if not best.finite else
           "it is the only one within the tolerance of the float32 reference"
           if best.close and not any(c.close for c in others) else
           "it needs fewer pins (more of the model stays 16-bit)"
           if any(len(c.added) > len(best.added) for c in others if c.finite) else
           "it is closer to the float32 reference with as few pins")
    return best, f"{best.compute_dtype} is better: {why}. " + "; ".join(_describe(c) for c in candidates)


def tune_policy(policy: Policy, run: RunFn, *, dtypes: Iterable[str] | None = None,
                framework: str = "", steps: int = 0, progress: Progress | None = None,
                max_rounds: int = 32, tolerance: float = TOLERANCE, tries: int = 3) -> TuneResult:
    """Search the fewest pins for ``policy`` with the backend's ``run`` (see the module docstring).

    ``dtypes``: the compute dtypes to consider (default: the policy's own); with several, the
    result keeps the best (finite first, then within ``tolerance``, then fewer pins, then the smaller
    gap from float32). ``tolerance``: the :func:`loss_gap` accepted; ``tries``: the ranked layers tried
    per divergence round (0: act on non-finite values only)."""
    start = time.perf_counter()
    if not isinstance(policy, Policy):  # the backends resolve names and files (backends.common.as_policy)
        raise TypeError(f"tune_policy takes a Policy; received {type(policy).__name__}")
    full, index, policy = policy, *_active_phase(policy, steps)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < math.inf:
        raise ValueError(f"tolerance: {tolerance!r} is not accepted; a loss gap >= 0, e.g. 0.05 for 5%")
    if isinstance(tries, bool) or not isinstance(tries, int) or tries < 0:
        raise ValueError(f"tries: {tries!r} is not accepted; an integer >= 0")
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
        candidates.append(_search(base, run, reference, progress, max_rounds, float(tolerance), tries))
    chosen, reason = _choose(candidates)
    if full.phases:
        reason += (f" (the [[phase]] in force over the {max(steps, 1)} step(s): phase {index + 1})" if index is not None
                   else " (the top-level settings, in force after the last [[phase]])")
    return TuneResult(full, _into_phase(full, index, chosen.policy), framework, steps, time.perf_counter() - start,
                      tuple(candidates), chosen, reason)


def _active_phase(policy: Policy, steps: int) -> tuple[int | None, Policy]:
    """For a policy with ``[[phase]]`` entries: the phase in force over steps 0 .. steps-1 of epoch 0
    (its index, None for the top level) and its complete policy; refused when the steps cross a bound."""
    if not policy.phases:
        return None, policy
    last = max(steps, 1) - 1
    first_i, last_i = policy.phase_index(step=0, epoch=0), policy.phase_index(step=last, epoch=0)
    if first_i != last_i:
        bound = policy.phases[first_i if first_i is not None else 0].until
        raise ValueError(f"tune runs steps 0 to {last}, which cross the [[phase]] bound at step {bound}; "
                         f"tune with steps <= {bound}, or tune a later phase's policy (policy.at(step=...)) on its own")
    return first_i, policy.at(step=0, epoch=0)


def _into_phase(full: Policy, index: int | None, tuned: Policy) -> Policy:
    """``full`` with the tuned fields (``keep_float32``, ``compute_dtype``) set where the phase tuned lives."""
    changes = {"keep_float32": tuned.keep_float32, "compute_dtype": tuned.compute_dtype}
    if not full.phases:
        return tuned
    if index is None:
        return full.replace(**changes)
    phases = list(full.phases)
    phases[index] = dataclasses.replace(phases[index], policy=phases[index].policy.replace(**changes))
    return full.replace(phases=tuple(phases))


def format_result(result: TuneResult) -> str:
    """The printable summary: what was added and why, the gap from float32, the evidence per layer."""
    c = result.chosen
    lines = [f"tune ({result.framework or 'backend'}): {result.steps} step(s) per run, "
             f"{sum(x.runs for x in result.candidates) + 1} run(s), {result.seconds:.1f} s",
             result.reason]
    if not c.finite:
        lines.append(f"not finite: {c.problem}; the policy below is the last one tried")
    gap = {k: "non-finite" if v is None else _pct(v) for k, v in (("before", c.gap_before), ("after", c.gap_after))}
    lines.append(f"loss gap from the float32 reference (mean over the steps): before {gap['before']}, "
                 f"after {gap['after']}, tolerance {_pct(c.tolerance)}; the tuned run skipped {c.skipped} step(s)")
    diff = result.diff()
    lines += ["added to the policy:", *(f"  {line}" for line in diff.splitlines())] if diff else [
        "nothing to add: the policy runs finite as it is"]
    rows = [e for e in c.evidence if e.nonfinite or e.pinned or (e.underflow or 0) > 0
            or (e.grad_rms_gap or 0) > 0.01 or (e.flushed or 0) > 0]
    if rows:
        lines.append("evidence (layer: where it went non-finite before its pin, pinned (for the gap), gradient "
                     "underflow share, gradient RMS gap from float32, gradients flushed to zero):")
        for e in rows:
            pin = ("pinned for the gap" if e.diverged else "pinned") if e.pinned else "-"
            lines.append(f"  {e.path}: {e.nonfinite or '-'}, {pin}, {_pct(e.underflow)}, {_pct(e.grad_rms_gap)}, "
                         f"{_pct(e.flushed)}")
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
        for i, batch in enumerate(taken):  # every backend's loop unpacks (inputs, target)
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                size = f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""
                raise TypeError(f"tune's batches are (inputs, target) pairs; batch {i} is a {type(batch).__name__}"
                                f"{size} (inputs may be a tuple of model arguments; loss_fn(outputs, target) "
                                "computes the loss)")
        return cls(steps, [taken[i % len(taken)] for i in range(steps)])
