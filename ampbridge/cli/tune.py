"""``ampbridge tune POLICY --model M:F --data M:F --loss M:F``: the backend's ``tune`` from the
command line; prints the summary, writes the tuned policy with ``-o``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..core import io as _io
from .common import InputError, UsageError, import_attribute, load_model, one_line


def _dtypes(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    wrong = [x for x in names if x not in ("float16", "bfloat16")]
    if not names or wrong:
        raise UsageError(f"--dtypes takes a comma list of float16, bfloat16; got {text!r}")
    return names


def cmd_tune(args: argparse.Namespace) -> int:
    from ..core.registry import backend_module, detect_backend

    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if not 0 <= args.tolerance < float("inf"):
        raise UsageError(f"--tolerance takes a loss gap >= 0 (0.05: 5%), got {args.tolerance}")
    dtypes = _dtypes(args.dtypes)
    policy = _io.load(args.policy)
    model, extras = load_model(args.model)
    data_fn = import_attribute(args.data, "--data", "mypkg.train:batches")
    loss = import_attribute(args.loss, "--loss", "mypkg.train:batches")
    try:
        data = data_fn() if callable(data_fn) else data_fn
    except Exception as e:
        raise InputError(f"--data {args.data}: the callable raised {one_line(e)}") from None
    name = detect_backend(model)
    if name is None:
        raise InputError(f"--model {args.model}: no installed backend recognises a {type(model).__qualname__}")

    def progress(line: str) -> None:
        print(f"ampbridge tune: {line}", file=sys.stderr, flush=True)

    try:
        result = backend_module(name).tune(model, policy, *extras, data, loss, steps=args.steps, dtypes=dtypes,
                                           progress=progress, tolerance=args.tolerance)
    except (TypeError, ValueError) as e:  # the user's model, data or loss did not fit together
        raise InputError(f"tune ({name}): {one_line(e)}") from None
    print(result.summary())
    if args.output:
        _io.dump(result.policy, args.output)
        print(f"tuned policy written to {args.output}")
    return 0 if result.finite else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tune", help="find the pins a policy needs: a short float32 reference run and the policy run")
    p.add_argument("policy", metavar="POLICY", help="a policy file")
    p.add_argument("--model", required=True, metavar="MODULE:CALLABLE",
                   help="a callable returning the model (Flax: (module, variables))")
    p.add_argument("--data", required=True, metavar="MODULE:CALLABLE", help="a callable returning (inputs, target) batches")
    p.add_argument("--loss", required=True, metavar="MODULE:CALLABLE", help="the loss function: loss(outputs, target)")
    p.add_argument("-o", "--output", metavar="TUNED.toml", default=None, help="write the tuned policy here")
    p.add_argument("--steps", type=int, default=8, help="training steps per run (default 8)")
    p.add_argument("--tolerance", type=float, default=0.05, help="the loss gap from the float32 reference "
                   "accepted (mean over the steps, relative; default 0.05)")
    p.add_argument("--dtypes", default=None, metavar="float16,bfloat16", help="compute dtypes to consider "
                   "(default: the policy's)")
    p.set_defaults(run=cmd_tune)
