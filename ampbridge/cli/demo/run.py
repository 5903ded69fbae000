"""``ampbridge demo [POLICY]``: one policy, trained in every installed framework, side by side.

It trains the demo model (``ampbridge.cli.demo``) with the policy (the shipped ``examples/amp.toml``
by default) in torch, Keras and Flax (and tf.keras 2 where ``tf_keras`` is installed: the same process,
see ``runners``), with one injected overflow step, and prints the Plan (one
table when the three agree), the loss-scale trajectory, the skipped steps and the final loss (step
times are ``make bench``'s: a few tiny steps time nothing). ``--plot FILE.png`` draws loss and loss scale per
framework. With no framework installed it shows the policy resolved and its Plan for the demo
model's layers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

from ...core import io as _io
from ...core.plan import Plan, build_plan, layers_from_data
from ...core.table import render_table
from ...errors import UnsupportedOptionError
from ..common import EXAMPLES, InputError, UsageError, defaults_notes

# what each framework's demo run imports (jmp only for the tests' native jmp run, not here)
_NEEDS = {"torch": ("torch",), "keras": ("keras",), "jax": ("jax", "flax", "optax"), "tf_keras": ("tf_keras",)}
#: the pip extra that installs each (where its name is not the framework's)
EXTRAS = {"tf_keras": "tf-keras"}


def _extra(framework: str) -> str:
    return f"ampbridge[{EXTRAS.get(framework, framework)}]"


def installed_frameworks() -> list[str]:
    return [fw for fw, mods in _NEEDS.items() if all(importlib.util.find_spec(m) for m in mods)]


class _Bar:
    """A one-line progress bar on stderr (redrawn in place on a terminal)."""

    def __init__(self, label: str, total: int):
        self.label, self.total = label, total
        self.tty = sys.stderr.isatty()

    def __call__(self, i: int) -> None:
        done = i + 1
        if self.tty or done == self.total:
            width = 30
            filled = width * done // self.total
            end = "\n" if done == self.total else ""
            sys.stderr.write(f"\r  {self.label:<26} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}{end}")
            sys.stderr.flush()


def _trajectory_table(runs: dict[str, Any], steps: int) -> str:
    """The steps where anything happens (first, skips, scale changes, last), framework by framework."""
    names = list(runs)
    interesting = {0, steps - 1}
    for r in runs.values():
        for i in range(steps):
            if r.skipped[i] or (i and r.scales[i] != r.scales[i - 1]):
                interesting.add(i)
    rows = []
    for i in sorted(interesting):
        cells = [str(i)]
        for n in names:
            r = runs[n]
            cells.append(f"{r.scales[i]:g}" + (" skipped" if r.skipped[i] else ""))
        rows.append(tuple(cells))
    return render_table(("step", *[f"scale ({n})" for n in names]), rows)


def _fp8_table(runs: dict[str, Any]) -> str:
    """The float8 scale (divisor) of the followed tensor after each step, framework by framework, and
    where the frameworks part (the scales come from amaxes of activations that differ in their last bits)."""
    from .runners import FP8_ROW

    names = [n for n, r in runs.items() if r.fp8_divisors]
    steps = min(len(runs[n].fp8_divisors) for n in names)
    rows = []
    for i in range(steps):
        values = [runs[n].fp8_divisors[i] for n in names]
        rows.append((str(i), *[f"{v:.9g}" for v in values], "yes" if len(set(values)) == 1 else "no"))
    same = next((i for i in range(steps) if rows[i][-1] == "no"), steps)
    head = (f"== float8: {FP8_ROW}'s input scale after each step (the divisor: x / scale is cast to e4m3; "
            f"delayed scaling, from the amax history)")
    tail = (f"identical in {', '.join(names)} for all {steps} steps" if same == steps else
            f"identical in {', '.join(names)} for steps 0-{same - 1}; they part at step {same}" if same else
            f"the frameworks differ from step 0")
    return "\n".join([textwrap.fill(head, 120, subsequent_indent="   "),
                      render_table(("step", *names, "same"), rows), tail])


def semantic_differences(first: Plan, other: Plan, promoted: frozenset[str]) -> tuple[list[str], list[str]]:
    """(differences, rows that differ only by the frameworks' own semantics): the output dtype of a
    torch row in ``promoted`` (its own code carries a promoted stream on, where Keras and Flax cast
    the next layer's inputs), said in that row's note."""
    rest, allowed = [], []
    for line in first.differences(other):
        path = line.split(": ", 1)[0]
        if path in promoted and line.startswith(f"{path}: output_dtype "):
            allowed.append(path)
        else:
            rest.append(line)
    return rest, allowed


def _side_by_side(plans: dict[str, Plan], promoted: frozenset[str] = frozenset()) -> str:
    names = list(plans)
    first = plans[names[0]]
    compared = [semantic_differences(first, plans[n], promoted) for n in names[1:]]
    if all(not rest for rest, _ in compared):
        table = first.table().replace(f"Plan ({first.framework}):", "Plan:", 1)  # one Plan, not torch's
        streams = sorted({p for _, allowed in compared for p in allowed})
        if not streams:
            return f"Plan (identical in {', '.join(names)}):\n" + table
        where = ", ".join(p or "(root)" for p in streams)
        why = (f"{where}: {first.framework} carries the promoted stream on (its row); {', '.join(names[1:])} cast "
               "the next layer's inputs")  # on its own lines: the heading stays under 120 characters
        return (f"Plan (identical in {', '.join(names)} but the output of {where}):\n"
                + textwrap.fill(why, 118, initial_indent="  ", subsequent_indent="    ") + "\n" + table)
    paths = list(dict.fromkeys(r.path for p in plans.values() for r in p.rows))
    rows = []
    for path in paths:
        cells = [path or "(root)"]
        for n in names:
            r = plans[n][path] if path in plans[n] else None
            cells.append(f"{r.compute_dtype}/{r.param_dtype}/{r.output_dtype}" if r else "-")
        rows.append(tuple(cells))
    return ("Plans differ (compute/param/output per framework; see `ampbridge explain` for the notes):\n"
            + render_table(("layer", *names), rows))


def plot_runs(runs: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from ...errors import BackendUnavailableError

        raise BackendUnavailableError("--plot needs matplotlib. Install with: pip install 'ampbridge[plot]'") from None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    # the curves coincide when the frameworks agree: distinct styles keep each one visible
    styles = [("-", 4.0), ("--", 2.5), (":", 2.0), ("-.", 1.5)]
    for (name, r), (style, width) in zip(runs.items(), styles):
        top.plot(range(len(r.losses)), r.losses, label=name, linestyle=style, linewidth=width)
        bottom.plot(range(len(r.scales)), r.scales, label=name, drawstyle="steps-post", linestyle=style,
                    linewidth=width)
        for i, s in enumerate(r.skipped):
            if s:
                bottom.axvline(i, color="red", alpha=0.25, linewidth=1)
    top.set_ylabel("training loss")
    top.set_title("ampbridge demo: one policy in " + ", ".join(runs) + " (gap: the skipped step)")
    top.legend()
    bottom.set_yscale("log", base=2)
    bottom.set_ylabel("loss scale (red: skipped step)")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _frameworks(given: str | None) -> list[str]:
    """The frameworks to train: ``--frameworks`` checked (unknown or not installed: a usage error),
    else every installed one (the others named on stderr)."""
    available = installed_frameworks()
    if given:
        wanted = [f.strip() for f in given.split(",") if f.strip()]
        unknown = [f for f in wanted if f not in _NEEDS and f != "none"]
        if unknown:
            raise UsageError(f"--frameworks: unknown {', '.join(unknown)}; accepted: {', '.join(_NEEDS)} or none")
        missing = [f for f in wanted if f in _NEEDS and f not in available]
        if missing:
            raise UsageError(f"--frameworks: not installed here: {', '.join(missing)} "
                             f"(pip install '{_extra(missing[0])}')")
        return [f for f in wanted if f in _NEEDS]
    absent = [fw for fw in _NEEDS if fw not in available]
    if available and absent:  # said, so a shorter table is not mistaken for the whole demo
        print(f"note: not installed here, so not trained: {', '.join(absent)} "
              f"(pip install {' '.join(repr(_extra(fw)) for fw in absent)})", file=sys.stderr)
    return available


def _print_finals(runs: dict[str, Any], frameworks: list[str]) -> None:
    """Final loss, skipped steps and final scale per framework, and how far the losses agree."""
    rows = []
    for fw in frameworks:
        r = runs[fw]
        skipped = [str(i) for i, s in enumerate(r.skipped) if s]
        rows.append((fw, f"{r.final_loss:.5f}",
                     f"{len(skipped)} (step{'s' if len(skipped) > 1 else ''} {', '.join(skipped)})" if skipped else "0",
                     f"{r.final_state.scale:g}" if r.final_state else "-"))
    print(render_table(("framework", "final loss", "skipped steps", "final scale"), rows))
    losses = [runs[fw].final_loss for fw in frameworks]
    if len(losses) > 1:
        spread = (max(losses) - min(losses)) / abs(min(losses))
        print(f"final losses agree to {spread:.1e} relative across {', '.join(frameworks)}")


def run_demo(args: argparse.Namespace) -> int:
    path = Path(args.policy) if args.policy else EXAMPLES / "amp.toml"
    policy, origins = _io.load_with_origins(path)
    frameworks = _frameworks(args.frameworks)
    if args.steps < 4:
        raise UsageError("--steps must be at least 4")
    if args.plot and not frameworks:
        raise UsageError(f"--plot {args.plot!r}: no framework is installed to train, so there is nothing to plot "
                         "(pip install 'ampbridge[all]')")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():  # say so before minutes of training
        raise InputError(f"--plot {args.plot!r}: cannot write it: no such directory {str(Path(args.plot).parent)!r}")
    print(f"== policy {path.name}")
    print(_io.render(_io.policy_to_dict(policy), "toml", defaults_notes(policy, origins, str(path))))
    if not frameworks:
        layers = layers_from_data(json.loads((EXAMPLES / "layers.json").read_text()), "layers.json")
        print("== no framework installed: the Plan for the demo model's layers (pip install 'ampbridge[all]' to train)")
        print(build_plan(layers, policy, warn=False).table())
        return 0

    from .runners import RUNNERS

    inject = (args.steps // 3,)
    print(f"== training {args.steps} steps in {', '.join(frameworks)}; step {inject[0]} gets an injected overflow "
          f"(its loss times inf)", flush=True)
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fw in frameworks:
            try:
                runs[fw] = RUNNERS[fw](policy, args.steps, inject, progress=_Bar(fw, args.steps))
            except UnsupportedOptionError as e:  # a framework that cannot realise a setting says so, by name
                print(textwrap.fill(f"  {fw:<26} not trained: {e}", 120, subsequent_indent=" " * 29), flush=True)
    if not runs:
        raise InputError(f"{path.name}: no installed framework realises this policy (see above)")
    frameworks = [fw for fw in frameworks if fw in runs]

    print()
    print(_side_by_side({fw: r.plan for fw, r in runs.items()}, runs["torch"].promoted if "torch" in runs else frozenset()))
    print()
    print("== loss scale (the steps where something happens)")
    print(_trajectory_table(runs, args.steps))
    print()
    if sum(1 for r in runs.values() if r.fp8_divisors) >= 1:
        print(_fp8_table(runs))
        print()
    _print_finals(runs, frameworks)
    # 40 tiny steps time nothing reliably (ratios swung 0.8-5.5x between two runs): make bench measures
    # them interleaved against native AMP, with medians and their spread
    print("step time against each framework's native AMP: `make bench` (docs/benchmarks.md)")
    if args.plot:
        plot_runs(runs, args.plot)
        print(f"plot written to {args.plot}")
    return 0
