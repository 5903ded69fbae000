"""``ampbridge tune POLICY --model M:F --data M:F --loss M:F``: the backend's ``tune`` from the
command line; prints the summary, writes the tuned policy with ``-o``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..core import io as _io
from .common import InputError, UsageError, load_model, one_line


def _attribute(spec: str, flag: str) -> Any:
    """``module:name`` resolved like ``--model`` (the working directory first on the path)."""
    import importlib
    import os

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{flag} takes module:callable (as in mypkg.train:batches), got {spec!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name.split(".")[0] and e.name != module_name:
            raise InputError(f"{flag} {spec}: importing {module_name!r} failed: {one_line(e)}") from None
        raise UsageError(f"{flag}: cannot import {module_name!r}: {e}") from None
    except Exception as e:
        raise InputError(f"{flag} {spec}: importing {module_name!r} failed: {one_line(e)}") from None
    finally:
        sys.path.pop(0)
    if not hasattr(module, attr):
        raise UsageError(f"{flag}: {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


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
    dtypes = _dtypes(args.dtypes)
    policy = _io.load(args.policy)
    model, extras = load_model(args.model)
    data_fn = _attribute(args.data, "--data")
    loss = _attribute(args.loss, "--loss")
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
                                           progress=progress)
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
    p.add_argument("--dtypes", default=None, metavar="float16,bfloat16", help="compute dtypes to consider "
                   "(default: the policy's)")
    p.set_defaults(run=cmd_tune)
