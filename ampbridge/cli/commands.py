"""The ``ampbridge`` command line.

Exit status: 0 success, 1 an invalid policy (or other bad input file), 2 bad usage.
User errors print one clear message, never a traceback.

Example:
    >>> main(["formats"])  # doctest: +ELLIPSIS
    dtype ...
    0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..core import io as _io
from ..core.dtypes import format_table, formats
from ..core.plan import Plan, build_plan, layers_from_data
from ..core.policy import Policy
from ..core.risks import lossy_settings
from ..errors import AmpBridgeError, PolicyError, Problem
from .common import EXAMPLES, InputError, UsageError, defaults_notes, read_text
from .common import load_model as _load_model
from .common import one_line as _one_line


def _example_policy() -> Path:
    return EXAMPLES / "amp.toml"


def _parse_at(text: str | None) -> dict[str, int] | None:
    if text is None:
        return None
    unit, sep, value = text.partition("=")
    if not sep or unit not in ("epoch", "step") or not value.strip().isdigit():
        raise UsageError(f"--at takes epoch=N or step=N (N >= 0), got {text!r}")
    return {unit: int(value)}


def _at(policy: Policy, at: dict[str, int] | None) -> Policy:
    if at is None:
        return policy
    unit = policy.phase_unit
    if unit is not None and unit not in at:
        raise UsageError(f"this policy's phases are scheduled by {unit}; use --at {unit}=N")
    return policy.at(**at)


def cmd_validate(args: argparse.Namespace) -> int:
    status = 0
    for name in args.files:
        try:
            policy = _io.load(name)
        except PolicyError as e:
            status = 1
            if len(e.problems) == 1:
                p = e.problems[0]
                print(f"invalid: {p}" if p.file else f"invalid: {name}: {p}", file=sys.stderr)
                continue
            print(f"invalid: {name}: {len(e.problems)} problems", file=sys.stderr)
            for p in e.problems:
                print(f"  {p}", file=sys.stderr)
        else:
            print(f"ok: {name}")
            for risk in lossy_settings(policy):
                print(f"warning: {name}: {risk}", file=sys.stderr)
    return status


def cmd_show(args: argparse.Namespace) -> int:
    policy, origins = _io.load_with_origins(args.file)
    at = _parse_at(args.at)
    if at is not None:
        policy = _at(policy, at)
        where = ", ".join(f"{k} {v}" for k, v in at.items())
        print(f"# the settings in force at {where}", file=sys.stderr if args.format == "json" else sys.stdout)
    notes = {} if args.format == "json" else defaults_notes(policy, origins, str(args.file))
    data = _io.policy_to_dict(policy)
    sys.stdout.write(_io.render(data, args.format, notes))
    if args.format == "json":
        filled = sorted(k for k, v in defaults_notes(policy, origins, str(args.file)).items() if v.startswith("default"))
        print(f"defaults filled: {', '.join(filled) or 'none'}", file=sys.stderr)
    return 0


def _plan_for(policy: Policy, args: argparse.Namespace) -> Plan:
    if args.layers:
        text = read_text(args.layers, "--layers")
        try:
            layers = layers_from_data(json.loads(text), str(args.layers))
        except json.JSONDecodeError as e:
            raise InputError(f"--layers {args.layers!r}: not valid JSON: {e}") from None
        except ValueError as e:
            raise InputError(f"--layers {args.layers!r}: {_one_line(e).removeprefix('ValueError: ')}") from None
        return build_plan(layers, policy)
    model, inputs = _load_model(args.model)
    import ampbridge

    return ampbridge.plan(model, policy, *inputs)


def cmd_explain(args: argparse.Namespace) -> int:
    import warnings

    from ..diagnostics.environment import effective_policy

    policy = _io.load(args.file)
    with warnings.catch_warnings(record=True) as switched:
        warnings.simplefilter("always")
        policy = effective_policy(policy, "explain")  # the Plan of what would run: the bisect switch applies
    for w in switched:
        print(f"warning: {w.message}", file=sys.stderr)
    at = _parse_at(args.at)
    policies = [(None, _at(policy, at))]
    if args.all_phases and policy.phases:
        policies = []
        start = 0
        for i, ph in enumerate(policy.phases):
            span = f"{policy.phase_unit} {start}" + (f"-{ph.until - 1}" if ph.until else "+")
            policies.append((f"phase[{i}] ({span})", ph.policy))
            start = ph.until or start
        if policy.phases[-1].until is not None:
            policies.append((f"after the schedule ({policy.phase_unit} {start}+)", policy.replace(phases=())))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plans = [(label, _plan_for(p, args)) for label, p in policies]
    if args.format == "json":
        data = [_plan_data(p, args.only_ruled) for _, p in plans]
        if len(plans) == 1:
            print(json.dumps(data[0], indent=2))
        else:
            print(json.dumps([{"phase": label, **d} for (label, _), d in zip(plans, data)], indent=2))
    else:
        for label, p in plans:
            if label:
                print(f"== {label}")
            print(p.table(only_ruled=args.only_ruled))
            print()
    for w in caught:
        if not issubclass(w.category, Warning) or "matches no layer" in str(w.message):
            continue  # already listed in the table
        print(f"warning: {w.message}", file=sys.stderr)
    return 0


def _plan_data(plan: Plan, only_ruled: bool) -> dict[str, Any]:
    data = plan.to_dict()
    if only_ruled:  # the rows a rule decided, as the table shows them
        data["rows"] = [r for r in data["rows"] if r.get("rule") != "default"]
    return data


def cmd_formats(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({k: f.as_dict() for k, f in formats().items()}, indent=2))
    else:
        print(format_table())
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from ..core.schema import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from ..diagnostics.report import format_summary, plot, summarize
    from ..diagnostics.runlog import read_log

    read_text(args.log, "the log")  # missing, a directory, binary: one line naming it
    try:
        log = read_log(args.log, partial=True)
    except ValueError as e:
        raise InputError(str(e)) from None
    if log.problem:  # the good part is reported; what ends it, in one line
        print(f"ampbridge report: warning: {log.problem}", file=sys.stderr)
    summary = summarize(log)
    print(json.dumps(summary.to_dict(), indent=2) if args.json else format_summary(summary))
    if args.plot:
        target = Path(args.plot)
        if target.is_dir():
            raise InputError(f"--plot {args.plot!r}: is a directory; give a file name such as run.png")
        if not target.suffix:  # matplotlib adds .png: name the file it writes
            target = target.with_suffix(".png")
        plot(log, str(target))
        print(f"plot written to {target}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..diagnostics.doctor import doctor

    from ..diagnostics.doctor import FRAMEWORK_NAMES

    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()] if args.frameworks else None
    unknown = [f for f in frameworks or () if f not in FRAMEWORK_NAMES]
    if unknown:
        raise UsageError(f"--frameworks: unknown {', '.join(unknown)}; accepted: {', '.join(FRAMEWORK_NAMES)}")
    print(doctor(frameworks))
    return 0


# --- convert / check --------------------------------------------------------------------------

_POLICY_SUFFIXES = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}


def _auto_arg(text: str) -> str:
    from ..recipes.convert import trainer_dtype as _trainer_dtype

    try:
        return _trainer_dtype(text, "--auto")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ds_version_arg(text: str) -> str:
    from ..recipes.deepspeed_releases import parse

    try:
        parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _tool_version_arg(tool: str, current: str) -> Any:
    def check(text: str) -> str:
        from ..recipes.tool_releases import parse

        try:
            parse(text, tool, current)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    return check


def _ds_version(args: argparse.Namespace) -> str | None:
    """--deepspeed-version, or the release the old --deepspeed-release names (both given must agree)."""
    from ..recipes.deepspeed_releases import resolve

    version, release = getattr(args, "deepspeed_version", None), getattr(args, "deepspeed_release", None)
    if version is None and release is None:
        return None
    try:
        return resolve(version, release)
    except ValueError as e:
        raise UsageError(f"--deepspeed-version/--deepspeed-release: {e}") from None


def _read_recipe(spec: str, fmt: str | None, args: argparse.Namespace, **extra: Any) -> Any:
    """A file, a ``FORMAT:VALUE`` (the value a file or a name), or a bare precision name -> its Conversion."""
    from .. import recipes
    from ..recipes.convert import _parse_text
    from ..recipes.formats import _READ_OPTIONS

    head, sep, rest = spec.partition(":")
    if sep and head in recipes.READ_FORMATS and fmt in (None, head) and not Path(spec).exists():
        fmt, spec = head, rest
    path = Path(spec)
    is_file = path.is_file()
    if not is_file and (path.suffix.lower() in _POLICY_SUFFIXES or "/" in spec or os.sep in spec):
        raise PolicyError([Problem("no such file", file=spec)])
    given = {"auto": getattr(args, "auto", None), "version": _ds_version(args), "device": getattr(args, "device", None),
             "api": getattr(args, "lightning_api", None), "half": getattr(args, "jmp_half", None),
             "accelerate_version": getattr(args, "accelerate_version", None),
             "lightning_version": getattr(args, "lightning_version", None)}
    given.update(extra)
    if is_file:
        detected = fmt or recipes.load(path).source_format  # detect first: pass only the options it takes
    else:
        detected = fmt or recipes.detect(_parse_text(spec, "", None)[0], source=spec)
    takes = _READ_OPTIONS.get(detected, ())
    options = {k: v for k, v in given.items() if v is not None and k in takes}
    if is_file:
        return recipes.load(path, detected, **options)
    return recipes.loads(spec, detected, **options)


def _render_result(result: Any, fmt: str, conversion: Any) -> str:
    if fmt == "accelerate":
        lines = [f"mixed_precision: {result['mixed_precision']!r}"]
        kwargs = result.get("grad_scaler_kwargs")
        if kwargs:
            args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            lines.append(f"# in code: Accelerator(kwargs_handlers=[GradScalerKwargs({args})])")
        if result.get("fp8_config"):  # the YAML's fp8_config section
            lines += ["fp8_config:"] + [f"  {k}: {json.dumps(v)}" for k, v in result["fp8_config"].items()]
        return "\n".join(lines) + "\n"
    if fmt == "jmp":
        return f"{result}\n"
    return json.dumps(result, indent=2) + "\n"


def cmd_convert(args: argparse.Namespace) -> int:
    from .. import recipes
    from ..core.policy import LossScaleConfig

    src = _read_recipe(args.src, args.src_format, args)
    result = src.result
    target = args.dst_format
    out_path = Path(args.output) if args.output else None
    losses = list(src.losses)
    notes = list(src.notes)
    if target == "ampbridge":
        fmt = args.format or (_POLICY_SUFFIXES.get(out_path.suffix.lower()) if out_path else None) or "toml"
        if isinstance(result, LossScaleConfig):
            data = {"loss_scale": result.to_dict()}
            header = "" if fmt == "json" else (f"# only loss-scale settings: {src.source_format} says nothing "
                                               "about dtypes\n")
            text = header + _io.render(data, fmt)
        else:
            text = _io.dumps(result, fmt)
    else:
        if isinstance(result, LossScaleConfig):
            if target not in ("grad-scaler", "flax", "optax"):
                raise UsageError(f"{src.source_format} settings hold only a loss scale; --to {target} needs a whole "
                                 "policy (convert to ampbridge, grad-scaler, flax or optax)")
        options: dict[str, Any] = {}
        if target == "deepspeed":
            options = {"via": args.deepspeed_via, "version": _ds_version(args), "stage": args.zero_stage}
        elif target == "lightning" and args.lightning_version:
            options = {"lightning_version": args.lightning_version}
        out = recipes.write(result, target, **options)
        losses += out.losses
        notes += [n for n in out.notes if n not in notes]  # an explanation both sides give, once
        text = _render_result(out.result, target, out)
    if src.state is not None:
        s = src.state
        notes.append(f"state: scale={s.scale!r}, good_steps={s.good_steps}, hysteresis_left={s.hysteresis_left} "
                     "(load it into the scaler to resume)")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for loss in losses:
        print(f"lost: {loss}", file=sys.stderr)
    if losses:
        print(f"{len(losses)} setting{'s' if len(losses) != 1 else ''} could not be expressed "
              f"({src.source_format} -> {target})", file=sys.stderr)
        if args.strict:
            print("--strict: nothing written", file=sys.stderr)
            return 1
    if out_path:
        try:
            out_path.write_text(text, encoding="utf-8")
        except OSError as e:
            raise InputError(f"-o {str(out_path)!r}: cannot write it: {e.strerror or e}") from None
        print(f"wrote {out_path}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from .. import recipes
    from ..core.io import PRESETS, preset

    if args.policy in PRESETS:  # as_policy's precedence: a preset name before a file of that name
        ref = recipes.Conversion(preset(args.policy), source_format="ampbridge",
                                 covers=frozenset(recipes.POLICY_FIELDS))
    else:
        ref = _read_recipe(args.policy, None, args)
    if not isinstance(ref.result, Policy):
        raise UsageError(f"{args.policy}: {ref.source_format} settings hold only a loss scale; check needs a policy")
    policy: Policy = ref.result
    others = []
    # the trainers' precision fills DeepSpeed's "auto": read them first
    trainer = args.auto
    for spec in args.against:
        conv = _read_recipe(spec, None, args, **({"auto": trainer} if trainer else {}))
        if conv.source_format in ("accelerate", "lightning") and trainer is None and isinstance(conv.result, Policy):
            trainer = conv.result.compute_dtype
        others.append((spec, conv))
    if trainer is None and ref.source_format != "deepspeed":
        trainer = policy.compute_dtype if policy.compute_dtype != "auto" else None
    resolved = []
    for spec, conv in others:
        if conv.source_format == "deepspeed" and trainer and any(l.value == "auto" for l in conv.losses):
            conv = _read_recipe(spec, "deepspeed", args, auto=trainer)
            conv = dataclasses.replace(conv, notes=conv.notes + (
                f"'auto' filled with {trainer} (the trainer's precision, or the policy's when no trainer "
                "config is given)",))
        resolved.append((spec, conv))
    variants = [(None, policy.replace(phases=()))]
    if policy.phases:
        variants = []
        start = 0
        for i, ph in enumerate(policy.phases):
            variants.append((f"phase[{i}] ({policy.phase_unit} {start}" + (f"-{ph.until - 1})" if ph.until else "+)"),
                             ph.policy))
            start = ph.until or start
        if policy.phases[-1].until is not None:
            variants.append((f"after the schedule ({policy.phase_unit} {start}+)", policy.replace(phases=())))
    total = 0
    for spec, conv in resolved:
        for label, variant in variants:
            found = recipes.disagreements(variant, conv)
            total += len(found)
            where = f" {label}" if label else ""
            head = f"{args.policy}{where} vs {spec} ({conv.source_format})"
            if not found:
                print(f"{head}: agrees")
            else:
                print(f"{head}: {len(found)} disagreement{'s' if len(found) != 1 else ''}")
                for d in found:
                    print(f"  {d}".replace(" other ", f" {conv.source_format} "))
        for loss in conv.losses:
            print(f"  cannot compare: {loss}")
        for note in conv.notes:
            print(f"  note: {note}", file=sys.stderr)
    print(f"{total} disagreement{'s' if total != 1 else ''}", file=sys.stderr)
    return 1 if total else 0


def cmd_init(args: argparse.Namespace) -> int:
    """Write the example policy (the demo's) where the user wants it: a wheel has no repository files."""
    target = Path(args.path)
    if target.is_dir():
        target = target / "amp.toml"
    if target.exists() and not args.force:
        raise InputError(f"{str(target)!r} exists; not overwritten (--force replaces it)")
    if not target.resolve().parent.is_dir():
        raise InputError(f"{str(target)!r}: no such directory {str(target.parent)!r}")
    text = (EXAMPLES / "amp.toml").read_text()
    try:
        target.write_text(text)
    except OSError as e:
        raise InputError(f"{str(target)!r}: cannot write it ({e.strerror or e})") from None
    print(f"wrote {target} (the example policy); next: ampbridge show {target}, or ampbridge demo {target}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo.run import run_demo

    return run_demo(args)


class _Parser(argparse.ArgumentParser):
    """argparse, with bad usage said in one line (exit 2) rather than the usage block and the error."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _tool_version_args(p: argparse.ArgumentParser) -> None:
    from ..recipes.tool_releases import ACCELERATE_CURRENT, LIGHTNING_CURRENT

    p.add_argument("--accelerate-version", type=_tool_version_arg("Accelerate", ACCELERATE_CURRENT), metavar="X.Y.Z",
                   default=None, help=f"the Accelerate release (default {ACCELERATE_CURRENT}, the one read; another is "
                   "read by its rules with a loss)")
    p.add_argument("--lightning-version", type=_tool_version_arg("Lightning", LIGHTNING_CURRENT), metavar="X.Y.Z",
                   default=None, help=f"the Lightning release (default {LIGHTNING_CURRENT}): precision names by "
                   "release, 16 on CPU")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ampbridge", description="One mixed-precision policy for PyTorch, Keras and JAX.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    _add_policy_commands(sub)
    _add_convert(sub)
    _add_check(sub)
    _add_tool_commands(sub)
    from .tune import add_parser as add_tune

    add_tune(sub)
    return parser


def _add_policy_commands(sub: Any) -> None:
    """validate, show, explain: a policy file read, resolved, planned."""
    p = sub.add_parser("validate", help="check policy files; every problem listed (exit 1 if any)")
    p.add_argument("files", nargs="+", metavar="FILE", help="policy files (.toml, .yaml, .json, pyproject.toml)")
    p.set_defaults(run=cmd_validate)

    p = sub.add_parser("show", help="print a policy resolved, with the defaults filled in")
    p.add_argument("file", metavar="FILE", help="a policy file")
    p.add_argument("--format", choices=_io.FORMATS, default="toml")
    p.add_argument("--at", metavar="epoch=N|step=N", help="the settings in force at that point of the schedule")
    p.set_defaults(run=cmd_show)

    p = sub.add_parser("explain", help="print the Plan: which layer runs in which dtype, and why")
    p.add_argument("file", metavar="FILE", help="a policy file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--layers", metavar="LAYERS.json", help="a JSON list of {path, kind, class, params}")
    src.add_argument("--model", metavar="MODULE:CALLABLE",
                     help="a callable returning a model (or (model, *example_inputs) for Flax)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--at", metavar="epoch=N|step=N", help="plan the phase in force at that point")
    p.add_argument("--all-phases", action="store_true", help="one plan per phase of the schedule")
    p.add_argument("--only-ruled", action="store_true", help="hide the rows the defaults decided")
    p.set_defaults(run=cmd_explain)


def _add_convert(sub: Any) -> None:
    from ..recipes import DEEPSPEED_RELEASES, DEEPSPEED_VERSION, READ_FORMATS, WRITE_FORMATS

    p = sub.add_parser("convert", help="read another tool's AMP settings (or a policy) and write them as an "
                       "ampbridge policy or for another tool; every setting that cannot be carried over is listed")
    p.add_argument("src", metavar="SRC", help="a file (ds_config.json, accelerate.yaml, amp.toml, ...), or a "
                   "precision name such as bf16-mixed, mixed_float16, p=f32,c=bf16")
    p.add_argument("--from", dest="src_format", choices=READ_FORMATS, help="the source format (default: detected)")
    p.add_argument("--to", dest="dst_format", choices=WRITE_FORMATS, default="ampbridge",
                   help="the target (default: an ampbridge policy)")
    p.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    p.add_argument("--format", choices=_io.FORMATS, help="the policy file format for --to ampbridge "
                   "(default: from OUT's suffix, else toml)")
    p.add_argument("--strict", action="store_true", help="exit 1 and write nothing if any setting is lost")
    p.add_argument("--auto", type=_auto_arg, metavar="fp16|bf16|no",
                   help="the trainer's precision, which fills DeepSpeed's \"auto\" values")
    p.add_argument("--deepspeed-version", type=_ds_version_arg, metavar="X.Y.Z", default=None,
                   help=f"the DeepSpeed release to read and write for (default {DEEPSPEED_VERSION}): its loss-scaler "
                   "growth test and which ZeRO stages skip non-finite steps")
    p.add_argument("--deepspeed-release", choices=DEEPSPEED_RELEASES, default=None,
                   help="older spelling of --deepspeed-version: modulo = 0.17.0, stable_interval = "
                   f"{DEEPSPEED_VERSION}")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="where Accelerate/Lightning run (default cuda): on CPU Accelerate runs fp16 as float32, "
                   "Lightning runs 16-mixed as bf16-mixed")
    p.add_argument("--lightning-api", choices=("trainer", "fabric"), default=None,
                   help="Lightning's Trainer (outputs not converted) or Fabric (outputs float32); not given: read "
                   "as Fabric, the Trainer's difference listed as lost")
    _tool_version_args(p)
    p.add_argument("--deepspeed-via", choices=("native", "torch_autocast", "amp"), default="native",
                   help="how --to deepspeed realises the policy (default: its fp16/bf16 modes)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="--to deepspeed: the ZeRO stage to write (zero_optimization.stage); it decides hysteresis "
                   "and which steps skip. Not given: none written, and what only ZeRO honours is listed as lost")
    p.add_argument("--jmp-half", choices=("float16", "bfloat16"), default=None,
                   help="what jmp's device-dependent 'half' means (default float16; bfloat16 on TPU)")
    p.set_defaults(run=cmd_convert)


def _add_check(sub: Any) -> None:
    from ..recipes import DEEPSPEED_RELEASES, DEEPSPEED_VERSION

    p = sub.add_parser("check", help="compare a policy with DeepSpeed/Accelerate/Lightning/... settings; every "
                       "disagreement listed (exit 1 if any)")
    p.add_argument("policy", metavar="POLICY", help="a policy file or preset (or any recipe convert reads)")
    p.add_argument("--against", nargs="+", required=True, metavar="OTHER",
                   help="files or precision names (FORMAT:VALUE to say which, e.g. lightning:bf16-mixed)")
    p.add_argument("--auto", type=_auto_arg, metavar="fp16|bf16|no", help="what fills DeepSpeed's \"auto\" values "
                   "(default: the Accelerate/Lightning settings given, else the policy's compute dtype)")
    p.add_argument("--deepspeed-version", type=_ds_version_arg, metavar="X.Y.Z", default=None,
                   help=f"the DeepSpeed release (default {DEEPSPEED_VERSION})")
    p.add_argument("--deepspeed-release", choices=DEEPSPEED_RELEASES, default=None,
                   help="older spelling of --deepspeed-version (modulo = 0.17.0)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="where Accelerate/Lightning run")
    p.add_argument("--lightning-api", choices=("trainer", "fabric"), default=None)
    _tool_version_args(p)
    p.set_defaults(run=cmd_check)


def _add_tool_commands(sub: Any) -> None:
    """formats, schema, report, doctor, init, demo."""
    p = sub.add_parser("formats", help="floating-point format facts of every dtype")
    p.add_argument("--json", action="store_true", help="as JSON, one object per dtype")
    p.set_defaults(run=cmd_formats)

    p = sub.add_parser("schema", help="the JSON Schema of the policy file")
    p.set_defaults(run=cmd_schema)

    p = sub.add_parser("report", help="summarise a numerics log (JSON Lines) with advice")
    p.add_argument("log", metavar="RUN.jsonl", help="the log a Monitor wrote")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="draw loss scale, skips and underflow")
    p.add_argument("--json", action="store_true", help="the summary as JSON")
    p.set_defaults(run=cmd_report)

    p = sub.add_parser("doctor", help="devices, native dtypes, the auto choice and matmul precision per framework")
    p.add_argument("--frameworks", default=None, help="comma list: torch, tensorflow (or keras), jax (default: all "
                   "installed)")
    p.set_defaults(run=cmd_doctor)

    p = sub.add_parser("init", help="write the example policy file to start from (amp.toml)")
    p.add_argument("path", nargs="?", default="amp.toml", metavar="PATH", help="file or directory (default: ./amp.toml)")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    p.set_defaults(run=cmd_init)

    p = sub.add_parser("demo", help="the example policy, planned and trained in every installed framework")
    p.add_argument("policy", nargs="?", default=None, metavar="POLICY", help="a policy file (default: the shipped "
                   "examples/amp.toml)")
    p.add_argument("--steps", type=int, default=40, help="training steps per framework")
    p.add_argument("--frameworks", default=None, help="comma list (default: every installed one)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="draw loss and loss scale (needs matplotlib)")
    p.set_defaults(run=cmd_demo)


def _version() -> str:
    from .. import __version__

    return f"ampbridge {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    # TensorFlow's C++ start-up lines would interleave with the demo's and doctor's output
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on bad usage
    try:
        return int(args.run(args))
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's 128 + SIGINT, wherever it landed
        print(f"ampbridge {args.command}: interrupted", file=sys.stderr)
        return 130
    except UsageError as e:
        print(f"ampbridge {args.command}: error: {e}", file=sys.stderr)
        return 2
    except PolicyError as e:
        what = "invalid input" if args.command in ("convert", "check") else "invalid policy"
        if len(e.problems) == 1:
            print(f"ampbridge {args.command}: {what}: {e.problems[0]}", file=sys.stderr)
            return 1
        print(f"ampbridge {args.command}: {what}: {len(e.problems)} problems", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    except AmpBridgeError as e:
        print(f"ampbridge {args.command}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `ampbridge schema | head`
        return 0
    except OSError as e:  # an output that cannot be written (a plot, a log), a file that vanished
        name = f"{e.filename}: " if e.filename else ""
        print(f"ampbridge {args.command}: error: {name}{e.strerror or e}", file=sys.stderr)
        return 1
    except Exception as e:  # never a traceback; AMPBRIDGE_TRACEBACK=1 shows it (for a bug report)
        if os.environ.get("AMPBRIDGE_TRACEBACK"):
            raise
        print(f"ampbridge {args.command}: internal error: {_one_line(e)} (AMPBRIDGE_TRACEBACK=1 shows where; "
              "please report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
