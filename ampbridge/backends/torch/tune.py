"""``tune`` for PyTorch: a few steps of a copy of the model in float32 and under the policy, through
``apply`` and its ``Monitor``; the search itself is ``ampbridge.diagnostics.tune`` (framework-free)."""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ...core.policy import Policy
from ...diagnostics.runlog import RunLog, read_log
from ...diagnostics.tune import TOLERANCE, StepCycle, TuneResult, tune_policy
from ..common import as_policy
from .apply import apply

__all__ = ["tune"]


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


def _train(model: torch.nn.Module, policy: Policy, batches: StepCycle, loss_fn: Callable[[Any, Any], Any],
           optimizer: Callable[[Any], Any], seed: int, folder: Path, index: int) -> RunLog:
    """One run on a fresh copy: every step logged by the monitor, the log read back."""
    work = copy.deepcopy(model)
    work.train()
    amp = apply(work, policy)
    opt = optimizer(work.parameters())
    path = folder / f"run{index}.jsonl"
    with torch.random.fork_rng(devices=[]):  # dropout draws the same in every run, the caller's RNG untouched
        torch.manual_seed(seed)
        with amp.monitor(path, every=1):
            for inputs, target in batches.batches:
                loss = loss_fn(_call(work, inputs), target)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError("loss_fn must return a single-element tensor; received "
                                    f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
                amp.step(loss, opt)
                opt.zero_grad(set_to_none=True)
    amp.remove()
    return read_log(path)


def tune(model: torch.nn.Module, policy: Policy | str | Path, batches: Iterable[Any],
         loss_fn: Callable[[Any, Any], Any], *, steps: int = 8, dtypes: Iterable[str] | None = None,
         optimizer: Callable[[Any], Any] | None = None, seed: int = 0,
         progress: Callable[[str], None] | None = None,
         tolerance: float = TOLERANCE) -> TuneResult:
    """The pins ``policy`` needs on ``model``, found from ``steps`` training steps on copies.

    ``batches``: ``(inputs, target)`` pairs (``inputs`` a tensor, or a tuple passed positionally);
    the first ``steps`` are used, cycled if there are fewer. ``loss_fn(outputs, target)`` returns the
    scalar loss. ``optimizer(params)`` builds each run's optimizer (default Adam, lr 1e-3). Each run
    trains a deep copy: the model, its weights and the global RNG are as they were.
    ``dtypes=("float16", "bfloat16")`` tries both compute dtypes and keeps the better.

    Example:
        >>> import torch, ampbridge
        >>> class Scale(torch.nn.Module):
        ...     def forward(self, x): return x * 1e6
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale(), torch.nn.LayerNorm(4), torch.nn.Linear(4, 1))
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1))]
        >>> result = ampbridge.torch.tune(model, "mixed_float16", data, torch.nn.functional.mse_loss, steps=2)
        >>> result.finite, result.added[0]  # the Scale; the LayerNorm too if float16 could not hold its input
        (True, '1')
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tune takes a torch.nn.Module; received {type(model).__name__}")
    cycle = StepCycle.of(batches, steps)
    make_opt = optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3))
    with tempfile.TemporaryDirectory(prefix="ampbridge-tune-") as tmp:
        count = iter(range(1 << 30))

        def run(p: Policy) -> RunLog:
            return _train(model, p, cycle, loss_fn, make_opt, seed, Path(tmp), next(count))

        return tune_policy(as_policy(policy), run, dtypes=dtypes, framework="torch", steps=steps, progress=progress,
                           tolerance=tolerance)

