"""``ampbridge report``: what a numerics log says, and what to do about it.

Example:
    >>> from ampbridge.diagnostics.runlog import RunLog
    >>> log = RunLog({"kind": "run", "framework": "jax", "compute_dtype": "float16", "layers": ["a"],
    ...               "min_scale": 1.0}, [{"step": 0, "loss": 1.0, "loss_scale": 1.0, "found_inf": True,
    ...               "skipped": True, "first_nonfinite": {"path": "a", "where": "output"}, "layers": {}}])
    >>> s = summarize(log)
    >>> s.skipped_steps, s.steps_at_min_scale, s.overflow_origins
    ([0], 1, {'a': 1})
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..core.table import render_table
from .runlog import RunLog

#: a layer is flagged when this fraction of its gradients would underflow without scaling
UNDERFLOW_WARN = 0.01
#: loss scaling is flagged as struggling when this fraction of steps is skipped
SKIP_WARN = 0.05
#: a float8 layer is flagged when a tensor's scaled amax passed the format's max by more than this
#: factor (or was non-finite): below it, the clip is the compute dtype's rounding of the max
#: (bfloat16's step at 448 is 2, a factor of 1.0045)
SATURATION_WARN = 1.01


@dataclass
class Summary:
    framework: str
    compute_dtype: str
    steps: int  # step records in the log (a sampling monitor logs every N-th step and every non-finite one)
    steps_run: int  # steps the run took: the closing record's count, else the last logged step + 1
    steps_counted: str  # where steps_run comes from: "closing record" or "last logged step"
    first_step: int | None  # the first and last step number the monitor saw (closing record; else None)
    last_step: int | None
    skipped: int  # steps skipped (the closing record's count, else the skipped steps in the log)
    skipped_steps: list[int]  # the skipped steps in the log
    scale_min: float
    scale_max: float
    scale_final: float
    min_scale: float | None
    steps_at_min_scale: int
    overflow_origins: dict[str, int]
    worst_underflow: list[tuple[str, float]]
    nonfinite_layers: dict[str, int]  # per layer: non-finite steps the log shows it non-finite on
    nonfinite_steps: int  # steps in the log with found_inf
    nonfinite_sampled: int  # of those, how many carry per-layer statistics
    final_loss: float | None
    final_loss_step: int | None = None  # the step final_loss was logged at
    scale_final_source: str = "the last logged step"  # or "rebuilt from the policy and the skipped steps"
    unreproduced: int = 0  # non-finite steps whose replay found everything finite
    advice: list[str] = field(default_factory=list)
    pinned: dict[str, str] = field(default_factory=dict)  # layers the policy already keeps in float32, by rule
    # per float8 layer, per tensor: steps recorded, max amax, saturated steps, the last scale (see _fp8_counts)
    fp8: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


#: ``first_nonfinite = {"path": "", "where": "input"}``: the model's inputs (or the root's own code)
MODEL_INPUTS = "(the model's inputs)"


def _origin_key(first: dict[str, Any]) -> str:
    return MODEL_INPUTS if not first.get("path") and first.get("where") == "input" else first["path"]


def summarize(log: RunLog) -> Summary:
    """The numbers ``ampbridge report`` prints.

    ``nonfinite_layers`` counts, per layer, the non-finite steps of the log on which it was
    non-finite: its statistics say so (a sampled step), or, on a step without statistics (a
    sampling monitor logs an unsampled non-finite step with its attribution only), it was the
    first layer to go non-finite. ``nonfinite_sampled`` says how many of those steps had statistics.
    """
    h, steps = log.header, log.steps
    scales = [s["loss_scale"] for s in steps] or [float("nan")]
    min_scale = h.get("min_scale")
    at_min = sum(1 for s in steps if min_scale is not None and s["loss_scale"] <= min_scale)
    origins = Counter(_origin_key(s["first_nonfinite"]) for s in steps
                      if s.get("first_nonfinite") and s["first_nonfinite"].get("where") != "unreproduced")
    unreproduced = sum(1 for s in steps if (s.get("first_nonfinite") or {}).get("where") == "unreproduced")
    mean_underflow, nonfinite, nonfinite_steps, nonfinite_sampled = _layer_counts(steps)
    losses = [(s["step"], s["loss"]) for s in steps if isinstance(s.get("loss"), float) and math.isfinite(s["loss"])]
    skipped_steps = [s["step"] for s in steps if s["skipped"]]
    steps_run, counted, first_step, last_step, skipped = _counted(log, skipped_steps)
    rebuilt = rebuild_scales(log)
    scale_final, final_source = scales[-1], "the last logged step"
    if rebuilt is not None:
        scale_final, final_source = rebuilt[-1][1], "rebuilt from the policy and the skipped steps"
    summary = Summary(
        framework=h.get("framework", "?"), compute_dtype=h.get("compute_dtype", "?"), steps=len(steps),
        steps_run=steps_run, steps_counted=counted, first_step=first_step, last_step=last_step,
        skipped=skipped, skipped_steps=skipped_steps,
        scale_min=min(scales + ([v for _, v in rebuilt] if rebuilt else [])),
        scale_max=max(scales + ([v for _, v in rebuilt] if rebuilt else [])),
        scale_final=scale_final, scale_final_source=final_source, min_scale=min_scale, steps_at_min_scale=at_min,
        overflow_origins=dict(origins.most_common()), worst_underflow=mean_underflow[:5],
        nonfinite_layers=dict(nonfinite.most_common()), nonfinite_steps=nonfinite_steps,
        nonfinite_sampled=nonfinite_sampled, final_loss=losses[-1][1] if losses else None,
        final_loss_step=losses[-1][0] if losses else None, unreproduced=unreproduced)
    summary.fp8 = _fp8_counts(steps)
    pinned = h.get("pinned")
    if isinstance(pinned, dict):
        summary.pinned = {str(k): str(v) for k, v in pinned.items()}
    summary.advice = advise(summary)
    return summary


def _layer_counts(steps: list[dict[str, Any]]) -> tuple[list[tuple[str, float]], Counter[str], int, int]:
    """Mean underflow per layer (worst first), and per layer the non-finite steps it was non-finite
    on (statistics, else the first layer to go non-finite); how many non-finite steps, how many sampled."""
    underflow: dict[str, list[float]] = {}
    nonfinite: Counter[str] = Counter()
    nonfinite_steps = nonfinite_sampled = 0
    for s in steps:
        layers = s.get("layers") or {}
        for path, stats in layers.items():
            if not math.isnan(stats.get("underflow", float("nan"))):
                underflow.setdefault(path, []).append(stats["underflow"])
        if not (s["found_inf"] or s["skipped"]):
            continue
        nonfinite_steps += 1
        nonfinite_sampled += bool(layers)
        bad = {path for path, stats in layers.items()
               if stats.get("nonfinite", 0) and not math.isnan(stats["nonfinite"])}
        first = (s.get("first_nonfinite") or {}).get("path")
        if first:
            bad.add(first)
        elif (s.get("first_nonfinite") or {}).get("where") == "input":
            bad.add(MODEL_INPUTS)
        nonfinite.update(bad)
    mean_underflow = sorted(((p, sum(v) / len(v)) for p, v in underflow.items()), key=lambda t: -t[1])
    return mean_underflow, nonfinite, nonfinite_steps, nonfinite_sampled


def _fp8_counts(steps: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per float8 layer, per tensor (input, weight, grad_output): the steps with float8 statistics,
    the largest amax, the saturated steps and of them those beyond the compute dtype's rounding
    (``clipped_steps``: scaled amax over ``SATURATION_WARN`` times the max, or non-finite), the
    largest scaled amax over the max (``max_over``), and the last scale (with its ``scale_op``).

    Example:
        >>> t = {"amax": 900.0, "scale": 1.0, "scale_op": "divide", "fp8_max": 448.0, "saturated": True}
        >>> _fp8_counts([{"step": 3, "fp8": {"d": {"input": t}}}])["d"]["input"]["saturated_steps"]
        [3]
    """
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for s in steps:
        for path, tensors in (s.get("fp8") or {}).items():
            for name, t in tensors.items():
                row = out.setdefault(path, {}).setdefault(
                    name, {"steps": 0, "max_amax": float("nan"), "saturated_steps": [], "clipped_steps": [],
                           "max_over": float("nan"), "last_scale": float("nan"), "scale_op": t["scale_op"]})
                row["steps"] += 1
                amax = t["amax"]
                row["zero_amax_steps"] = row.get("zero_amax_steps", 0) + (amax == 0.0)
                if not math.isnan(amax) and (math.isnan(row["max_amax"]) or amax > row["max_amax"]):
                    row["max_amax"] = amax  # a NaN amax is not a size (it counts as saturated)
                over = t.get("scaled_amax", float("nan")) / t["fp8_max"]
                if not math.isnan(over) and (math.isnan(row["max_over"]) or over > row["max_over"]):
                    row["max_over"] = over  # the scaled amax over the format's max, at its largest
                if t["saturated"]:
                    row["saturated_steps"].append(s["step"])
                    if not (over <= SATURATION_WARN):  # beyond rounding, a non-finite amax, or an older record
                        row["clipped_steps"].append(s["step"])
                row["last_scale"], row["scale_op"] = t["scale"], t["scale_op"]
    return out


def fp8_saturated(s: Summary) -> dict[str, list[int]]:
    """Per float8 layer that saturated beyond rounding: the steps on which any of its tensors did."""
    out = {}
    for path, tensors in s.fp8.items():
        steps = sorted({step for t in tensors.values() for step in t["clipped_steps"]})
        if steps:
            out[path] = steps
    return out


def fp8_unrecorded(s: Summary) -> dict[str, list[str]]:
    """Per float8 layer, its delayed-scaling input/weight tensors whose amax was 0 on every recorded
    step (two or more): their scale never followed the data (e.g. a Keras float8 Dense never called
    with training=True keeps scale 1, or stores 0 under JAX)."""
    out = {}
    for path, tensors in s.fp8.items():
        names = [name for name, t in tensors.items() if name in ("input", "weight") and t["scale_op"] == "divide"
                 and t["steps"] >= 2 and t.get("zero_amax_steps", 0) == t["steps"]]
        if names:
            out[path] = names
    return out


def _counted(log: RunLog, skipped_steps: list[int]) -> tuple[int, str, int | None, int | None, int]:
    """Steps run, what counted them, the first and last step, and the skips: the closing record's
    when the log has one, else what the logged steps show."""
    end = log.end
    if end is not None:
        return end["steps"], "closing record", end["first_step"], end["last_step"], end["skipped"]
    steps_run = max((s["step"] for s in log.steps), default=-1) + 1
    return steps_run, "last logged step", None, None, len(skipped_steps)


def advise(s: Summary) -> list[str]:
    """Plain-words advice where the numbers call for it."""
    out = []
    run = max(s.steps_run, 1)
    if s.steps_run and s.skipped / run > SKIP_WARN:
        out.append(f"{s.skipped} of {s.steps_run} steps were skipped ({100 * s.skipped / run:.0f}%): "
                   "gradients overflow often" + (" - consider bfloat16, which has float32's range"
                                                 if s.compute_dtype == "float16" else ""))
    if s.unreproduced:
        out.append(f"{s.unreproduced} non-finite step(s) could not be reproduced: replayed, every layer's outputs, "
                   "the loss and every gradient were finite (the weights or inputs changed between the forward "
                   "and the step, or the overflow is not deterministic); no layer can be named for them")
    for path, count in list(s.overflow_origins.items())[:3]:
        if path == "":
            out.append(f"the loss itself was non-finite on {count} step(s) while every layer's outputs were "
                       "finite: check the loss computation and its inputs (labels, weights), "
                       "and compute it in float32 (output_dtype = \"float32\")")
            continue
        if path == MODEL_INPUTS:
            out.append(f"the model's inputs (or its root's own code) were non-finite on {count} step(s) before any "
                       "layer ran: check the data")
            continue
        rule = s.pinned.get(path)
        if rule is not None:  # never advise a pin the policy already has
            out.append(f"{path} was the first layer to go non-finite on {count} step(s), though it already computes "
                       f"in float32 ({rule}): its own float32 output overflowed; check its inputs and weights")
            continue
        out.append(f"{path} was the first layer to go non-finite on {count} step(s): pin it "
                   f'(keep_float32 = ["{path}"]) or check its inputs')
    for path, steps in fp8_saturated(s).items():
        which = [f"{name} ({len(t['clipped_steps'])} step(s), up to {t['max_over']:.3g} times the max)"
                 for name, t in s.fp8[path].items() if t["clipped_steps"]]
        delayed = any(t["scale_op"] == "divide" for t in s.fp8[path].values() if t["clipped_steps"])
        why = ("delayed scaling scales a step by earlier steps' amaxes, so a jump past the history's largest is "
               "clipped: if it recurs, leave the layer out of fp8.match or pin it (keep_float32)"
               if delayed else "current scaling clips only a non-finite amax: check the layer's inputs")
        out.append(f"{path} saturated float8 on {len(steps)} step(s) (first at step {steps[0]}): {', '.join(which)} "
                   f"went beyond the format's max after scaling and were clipped to it; {why}")
    for path, names in fp8_unrecorded(s).items():
        steps = s.fp8[path][names[0]]["steps"]
        out.append(f"{path}: its float8 {' and '.join(names)} recorded no amax on any of {steps} recorded steps (scale "
                   f"{s.fp8[path][names[0]]['last_scale']:g}): the scale never followed the data, so values are cast "
                   "to float8 unscaled. Keras's float8 Dense updates its scales only when called with training=True: "
                   "pass training=training down to it in your model's call (docs/fp8.md)")
    if s.min_scale is not None and s.steps_at_min_scale:
        out.append(f"the loss scale sat at min_scale={s.min_scale:g} for {s.steps_at_min_scale} step(s): the "
                   "gradients overflow even unscaled; find the overflowing layer (above) or use bfloat16"
                   + ("; raising min_scale would only hide it" if s.steps_at_min_scale > 1 else ""))
    for path, frac in s.worst_underflow:
        if frac >= UNDERFLOW_WARN:
            out.append(f"{path}: {100 * frac:.1f}% of its gradients would underflow in {s.compute_dtype} without "
                       "loss scaling: keep dynamic scaling on (or raise min_scale), or pin the layer to float32")
    return out


def _steps_line(s: Summary) -> str:
    if s.steps_counted == "closing record":
        span = f" (steps {s.first_step}-{s.last_step})" if s.first_step is not None and s.steps_run > 1 else ""
        return f"{s.steps_run} step(s){span}, {s.steps} in the log"
    return f"{s.steps_run} step(s) (to the last logged step: the log has no closing record), {s.steps} in the log"


def format_summary(s: Summary) -> str:
    lines = [f"run: {s.framework}, compute {s.compute_dtype}, {_steps_line(s)}"]
    skipped = ", ".join(map(str, s.skipped_steps[:20])) + (" ..." if len(s.skipped_steps) > 20 else "")
    lines.append(f"skipped steps: {s.skipped}" + (f" ({skipped})" if s.skipped_steps else ""))
    lines.append(f"loss scale: min {s.scale_min:g}, max {s.scale_max:g}, final {s.scale_final:g} "
                 f"({s.scale_final_source})"
                 + (f"; at min_scale={s.min_scale:g} for {s.steps_at_min_scale} step(s)" if s.min_scale is not None else ""))
    if s.final_loss is not None:
        at_end = s.last_step is not None and s.final_loss_step == s.last_step
        lines.append(f"final loss: {s.final_loss:.6g} (step {s.final_loss_step}"
                     + (", the last step)" if at_end else ", the last finite loss logged)"))
    if s.overflow_origins:
        lines.append("first layer to go non-finite, by steps: "
                     + ", ".join(f"{p or '(the loss)'} ({n})" for p, n in s.overflow_origins.items()))
    saturated = fp8_saturated(s)
    if saturated:
        lines.append("float8 saturation, by steps: " + ", ".join(f"{p} ({len(v)})" for p, v in saturated.items()))
    rows = [p for p, _ in s.worst_underflow] + [p for p in s.nonfinite_layers if p not in dict(s.worst_underflow)]
    if rows:
        under = dict(s.worst_underflow)
        lines.append("layers: the worst by mean fraction of gradients that would underflow unscaled, and every "
                     "one that went non-finite:")
        lines.append(render_table(("layer", "underflow", "steps non-finite"),
                                  [(p, f"{100 * under[p]:.2f}%" if p in under else "-",
                                    str(s.nonfinite_layers.get(p, 0))) for p in rows]))
        if s.nonfinite_steps > s.nonfinite_sampled:
            lines.append(f"  ({s.nonfinite_steps - s.nonfinite_sampled} of the {s.nonfinite_steps} non-finite steps "
                         "have no per-layer statistics (a torch fused optimizer's unread steps, or an older log): "
                         "on those only the first layer to go non-finite is known, and counted)")
    if s.fp8:
        lines.append("float8 layers (the steps with float8 statistics; saturated: clipped to the format's max, "
                     f"flagged beyond {SATURATION_WARN:g} times it; scale as the framework keeps it: / divides, "
                     "* multiplies):")
        lines.append(render_table(
            ("layer", "tensor", "steps", "max amax", "max scaled/max", "saturated steps", "last scale"),
            [(p, name, str(t["steps"]), f"{t['max_amax']:g}", f"{t['max_over']:.4g}",
              str(len(t["saturated_steps"])) + (f" ({', '.join(map(str, t['saturated_steps'][:10]))}"
                                                f"{' ...' if len(t['saturated_steps']) > 10 else ''})"
                                                if t["saturated_steps"] else ""),
              ("/ " if t["scale_op"] == "divide" else "* ") + f"{t['last_scale']:g}")
             for p, tensors in s.fp8.items() for name, t in tensors.items()]))
    lines.append("advice:" if s.advice else "advice: none; the numbers look healthy")
    lines += [f"  - {a}" for a in s.advice]
    return "\n".join(lines)


def _loss_scale_config(header: dict[str, Any]) -> Any:
    """The run's loss-scale config from the header's policy, or None (none, unreadable, or phases)."""
    policy = header.get("policy")
    if not isinstance(policy, dict) or not policy or policy.get("phase"):
        return None
    try:
        from ..core.policy import Policy

        return Policy.from_dict(policy).resolved_loss_scale
    except Exception:  # a log from another version: no prediction, the curve holds instead
        return None


def rebuild_scales(log: RunLog) -> list[tuple[int, float]] | None:
    """The loss scale after every step of the run, rebuilt exactly from the policy in the header and
    the non-finite steps in the log (a sampling monitor logs every one of them), or None when it
    cannot be: no closing record or no readable policy (or phases), a run the monitor joined after
    its first step, or a log whose scales disagree with the rebuild at some logged step.

    Example:
        >>> log = RunLog({"policy": {"loss_scale": {"mode": "dynamic", "initial_scale": 8.0,
        ...                                         "growth_interval": 2}}},
        ...              [{"step": 0, "loss_scale": 8.0, "found_inf": True, "skipped": True}],
        ...              end={"steps": 4, "skipped": 1, "first_step": 0, "last_step": 3})
        >>> rebuild_scales(log)
        [(0, 4.0), (1, 4.0), (2, 8.0), (3, 8.0)]
    """
    from ..core.loss_scale import initial_state, next_state

    cfg, end = _loss_scale_config(log.header), log.end
    if cfg is None or end is None or end.get("first_step") != 0 or end.get("last_step") is None or not log.steps:
        return None
    state = initial_state(cfg)
    used = {s["step"]: s for s in log.steps}
    bad = {step for step, s in used.items() if s["found_inf"]}
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(end["last_step"] + 1):
            if step in used and used[step]["loss_scale"] != state.scale:
                return None  # the log disagrees (another policy ran, or a step is missing)
            try:
                state = next_state(cfg, state, step in bad)
            except Exception:  # on_min_scale = "error": the run stopped at this step
                out.append((step, state.scale))
                return out
            out.append((step, state.scale))
    return out


def scale_after_steps(log: RunLog) -> list[tuple[int, float]]:
    """The loss scale after each logged step (the scale the next step uses), as (step, scale).

    The log holds the scale each step used, so the scale after step ``s`` is exact where step
    ``s + 1`` is logged; after a skipped step whose successor is not, it is the reference
    algorithm's backoff (``ampbridge.core.loss_scale``) when the policy's ``hysteresis`` is 1; otherwise
    the step's own scale is held (a change between logged steps shows at the step before the next
    logged one: sampling cannot see when a growth happened).

    Example:
        >>> log = RunLog({"policy": {}}, [{"step": s, "loss_scale": v, "found_inf": f, "skipped": f}
        ...               for s, v, f in ((0, 4.0, False), (14, 4.0, True), (15, 2.0, False))])
        >>> scale_after_steps(log)
        [(0, 4.0), (13, 4.0), (14, 2.0), (15, 2.0)]
    """
    from ..core.loss_scale import LossScaleState, next_state

    rebuilt = rebuild_scales(log)
    if rebuilt is not None:  # every step's scale, growths where they happened
        return rebuilt
    used = {s["step"]: s for s in log.steps}
    cfg = _loss_scale_config(log.header)
    points: dict[int, float] = {}
    for step in sorted(used):
        if step - 1 >= min(used) and step - 1 not in points:
            points[step - 1] = used[step]["loss_scale"]
    for step, record in sorted(used.items()):
        if step + 1 in used:
            points[step] = used[step + 1]["loss_scale"]
            continue
        after = record["loss_scale"]
        if record["found_inf"] and cfg is not None and (cfg.mode != "dynamic" or cfg.hysteresis == 1):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    after = next_state(cfg, LossScaleState(scale=after, hysteresis_left=1), True).scale
            except Exception:  # on_min_scale = "error": the run stopped at this step
                pass
        points[step] = after
    return sorted(points.items())


def plot(log: RunLog, path: str) -> None:
    """Write :func:`figure` as a PNG."""
    fig = figure(log)
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)


def figure(log: RunLog) -> Any:
    """The loss, the loss scale after each step with the skipped steps, and per-layer underflow
    fractions over steps (a matplotlib Figure, three axes sharing the step axis).

    The scale curve is the scale in force after each step (:func:`scale_after_steps`), drawn as a
    staircase that changes at the step that changed it: a skipped step's backoff drops at that
    step. It runs to the closing record's last step where the log has one.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from ..errors import BackendUnavailableError

        raise BackendUnavailableError("--plot needs matplotlib. Install with: pip install 'ampbridge[plot]'") from None
    summary = summarize(log)
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    skipped = summary.skipped_steps
    losses = [(s["step"], s["loss"]) for s in log.steps
              if isinstance(s.get("loss"), float) and math.isfinite(s["loss"])]
    if losses:
        top.plot(*zip(*losses), marker=".", markersize=3, linewidth=1, label="loss")
    top.set_ylabel("loss (logged steps)")
    points = scale_after_steps(log)
    if points and summary.last_step is not None and summary.last_step > points[-1][0]:
        points.append((summary.last_step, points[-1][1]))  # the steps after the last logged one
    if points:
        middle.plot(*zip(*points), drawstyle="steps-post", label="loss scale")
    middle.set_yscale("log", base=2)
    middle.set_ylabel("loss scale after each step\n(the scale the next step uses)")
    for axis in (top, middle):
        for i, x in enumerate(skipped):
            axis.axvline(x, color="red", alpha=0.4, linewidth=1, label="skipped step" if i == 0 else None)
        if axis.lines:
            axis.legend(loc="best")
    top.set_title(f"{summary.framework} / {summary.compute_dtype}: {summary.skipped} skipped of "
                  f"{summary.steps_run} steps ({summary.steps} in the log)")
    for layer in log.header.get("layers", []):
        xs, ys = [], []
        for s in log.steps:
            stats = s.get("layers", {}).get(layer)
            if stats and not math.isnan(stats.get("underflow", float("nan"))):
                xs.append(s["step"])
                ys.append(100 * stats["underflow"])
        if xs:
            bottom.plot(xs, ys, label=layer)
    bottom.set_ylabel("% gradients underflowing unscaled")
    bottom.set_xlabel("step")
    if bottom.lines:
        bottom.legend(fontsize="small", ncol=2, loc="best")
    fig.tight_layout()
    return fig
