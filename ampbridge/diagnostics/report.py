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
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..core.table import render_table
from .runlog import RunLog

#: a layer is flagged when this fraction of its gradients would underflow without scaling
UNDERFLOW_WARN = 0.01
#: loss scaling is flagged as struggling when this fraction of steps is skipped
SKIP_WARN = 0.05


@dataclass
class Summary:
    framework: str
    compute_dtype: str
    steps: int  # steps in the log (a sampling monitor logs every N-th step and every skipped one)
    steps_run: int  # steps the run took (the last logged step + 1)
    skipped_steps: list[int]
    scale_min: float
    scale_max: float
    scale_final: float
    min_scale: float | None
    steps_at_min_scale: int
    overflow_origins: dict[str, int]
    worst_underflow: list[tuple[str, float]]
    nonfinite_layers: dict[str, int]
    final_loss: float | None
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def summarize(log: RunLog) -> Summary:
    h, steps = log.header, log.steps
    scales = [s["loss_scale"] for s in steps] or [float("nan")]
    min_scale = h.get("min_scale")
    at_min = sum(1 for s in steps if min_scale is not None and s["loss_scale"] <= min_scale)
    origins = Counter(s["first_nonfinite"]["path"] for s in steps if s.get("first_nonfinite"))
    underflow: dict[str, list[float]] = {}
    nonfinite: Counter[str] = Counter()
    for s in steps:
        for path, stats in s.get("layers", {}).items():
            if not math.isnan(stats.get("underflow", float("nan"))):
                underflow.setdefault(path, []).append(stats["underflow"])
            if stats.get("nonfinite", 0) and not math.isnan(stats["nonfinite"]):
                nonfinite[path] += 1
    mean_underflow = sorted(((p, sum(v) / len(v)) for p, v in underflow.items()), key=lambda t: -t[1])
    losses = [s["loss"] for s in steps if isinstance(s.get("loss"), float) and math.isfinite(s["loss"])]
    summary = Summary(
        framework=h.get("framework", "?"), compute_dtype=h.get("compute_dtype", "?"), steps=len(steps),
        steps_run=max((s["step"] for s in steps), default=-1) + 1,
        skipped_steps=[s["step"] for s in steps if s["skipped"]], scale_min=min(scales), scale_max=max(scales),
        scale_final=scales[-1], min_scale=min_scale, steps_at_min_scale=at_min,
        overflow_origins=dict(origins.most_common()), worst_underflow=mean_underflow[:5],
        nonfinite_layers=dict(nonfinite.most_common()), final_loss=losses[-1] if losses else None)
    summary.advice = advise(summary)
    return summary


def advise(s: Summary) -> list[str]:
    """Plain-words advice where the numbers call for it."""
    out = []
    run = max(s.steps_run, 1)
    if s.steps_run and len(s.skipped_steps) / run > SKIP_WARN:
        out.append(f"{len(s.skipped_steps)} of {s.steps_run} steps were skipped ({100 * len(s.skipped_steps) / run:.0f}%): "
                   "gradients overflow often" + (" - consider bfloat16, which has float32's range"
                                                 if s.compute_dtype == "float16" else ""))
    for path, count in list(s.overflow_origins.items())[:3]:
        if path == "":
            out.append(f"the loss itself was non-finite on {count} step(s) while every layer's outputs and "
                       "gradients were finite: check the loss computation and its inputs (labels, weights), "
                       "and compute it in float32 (output_dtype = \"float32\")")
            continue
        out.append(f"{path} was the first layer to go non-finite on {count} step(s): pin it "
                   f'(keep_float32 = ["{path}"]) or check its inputs')
    if s.min_scale is not None and s.steps_at_min_scale:
        out.append(f"the loss scale sat at min_scale={s.min_scale:g} for {s.steps_at_min_scale} step(s): the "
                   "gradients overflow even unscaled; find the overflowing layer (above) or use bfloat16"
                   + ("; raising min_scale would only hide it" if s.steps_at_min_scale > 1 else ""))
    for path, frac in s.worst_underflow:
        if frac >= UNDERFLOW_WARN:
            out.append(f"{path}: {100 * frac:.1f}% of its gradients would underflow in {s.compute_dtype} without "
                       "loss scaling: keep dynamic scaling on (or raise min_scale), or pin the layer to float32")
    return out


def format_summary(s: Summary) -> str:
    lines = [f"run: {s.framework}, compute {s.compute_dtype}, {s.steps_run} step(s), {s.steps} in the log"]
    skipped = ", ".join(map(str, s.skipped_steps[:20])) + (" ..." if len(s.skipped_steps) > 20 else "")
    lines.append(f"skipped steps: {len(s.skipped_steps)}" + (f" ({skipped})" if s.skipped_steps else ""))
    lines.append(f"loss scale: min {s.scale_min:g}, max {s.scale_max:g}, final {s.scale_final:g}"
                 + (f"; at min_scale={s.min_scale:g} for {s.steps_at_min_scale} step(s)" if s.min_scale is not None else ""))
    if s.final_loss is not None:
        lines.append(f"final loss: {s.final_loss:.6g}")
    if s.overflow_origins:
        lines.append("first layer to go non-finite, by steps: "
                     + ", ".join(f"{p or '(the loss)'} ({n})" for p, n in s.overflow_origins.items()))
    if s.worst_underflow:
        lines.append("worst layers (mean fraction of gradients that would underflow unscaled):")
        lines.append(render_table(("layer", "underflow", "steps non-finite"),
                                  [(p, f"{100 * f:.2f}%", str(s.nonfinite_layers.get(p, 0))) for p, f in s.worst_underflow]))
    lines.append("advice:" if s.advice else "advice: none; the numbers look healthy")
    lines += [f"  - {a}" for a in s.advice]
    return "\n".join(lines)


def plot(log: RunLog, path: str) -> None:
    """Loss scale and skip events over steps, and per-layer underflow fractions, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from ..errors import BackendUnavailableError

        raise BackendUnavailableError("--plot needs matplotlib. Install with: pip install 'ampbridge[plot]'") from None
    steps = [s["step"] for s in log.steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    top.plot(steps, [s["loss_scale"] for s in log.steps], drawstyle="steps-post", label="loss scale")
    top.set_yscale("log", base=2)
    skipped = [s["step"] for s in log.steps if s["skipped"]]
    for i, x in enumerate(skipped):
        top.axvline(x, color="red", alpha=0.4, linewidth=1, label="skipped step" if i == 0 else None)
    top.set_ylabel("loss scale")
    top.set_title(f"{log.header.get('framework', '?')} / {log.header.get('compute_dtype', '?')}: "
                  f"{len(skipped)} skipped of {len(steps)}")
    top.legend(loc="best")
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
