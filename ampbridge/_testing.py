"""Test support: import an optional dependency, or skip, or (when required) fail.

``AMPBRIDGE_REQUIRE`` lists what must be importable (comma separated, or ``all``); ``make test``
and CI set it to ``all`` so a missing framework fails the run instead of skipping silently.

Example:
    >>> require("json").__name__
    'json'
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from collections.abc import Iterator
from types import ModuleType


def required(name: str) -> bool:
    wanted = {w.strip() for w in os.environ.get("AMPBRIDGE_REQUIRE", "").split(",") if w.strip()}
    return "all" in wanted or name in wanted or name.split(".")[0] in wanted


def require(name: str, reason: str = "") -> ModuleType:
    """Import ``name``; when it is missing, skip the test, or fail it when it is required."""
    import pytest

    try:
        return importlib.import_module(name)
    except ImportError as e:
        message = f"{name} is not installed{': ' + reason if reason else ''} ({e})"
        if required(name):
            pytest.fail(f"{message}, and AMPBRIDGE_REQUIRE asks for it", pytrace=False)
        pytest.skip(message)
        raise  # unreachable: skip raises


class DeepSpeedDynamicLossScaler:
    """DeepSpeed's ``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/loss_scaler.py),
    transcribed as a test oracle: scale_factor 2 both ways, ``delayed_shift`` = hysteresis, and
    ZeRO's ``raise_error_at_min_scale``.

    ``growth_test="modulo"``: DeepSpeed 0.9.3-0.17.0, before commit e440506 (PR 6976),
    ``(cur_iter - last_overflow_iter) % scale_window == 0`` (what ampbridge's reference matches).
    ``growth_test="stable_interval"``: commit e440506 (PR 6976), first released in 0.17.1,
    ``stable_interval = cur_iter - last_overflow_iter - 1; stable_interval > 0 and
    stable_interval % scale_window == 0`` (one step later after every overflow).

    Example:
        >>> ds = DeepSpeedDynamicLossScaler(8.0, 2, 1.0, 1, False)
        >>> for overflow in (True, False, False):
        ...     ds.update_scale(overflow)
        >>> ds.cur_scale
        8.0
    """

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int,
                 consecutive_hysteresis: bool, raise_error_at_min_scale: bool = True, growth_test: str = "modulo"):
        if growth_test not in ("modulo", "stable_interval"):
            raise ValueError(f"growth_test={growth_test!r}; accepted: modulo, stable_interval")
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_factor, self.scale_window, self.min_scale = 2.0, scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.growth_test = growth_test

    @classmethod
    def from_config(cls, config: dict, growth_test: str = "modulo") -> "DeepSpeedDynamicLossScaler":
        """Built from a DeepSpeed config's ``fp16`` section, with DeepSpeed's defaults."""
        fp16 = config["fp16"]
        return cls(init_scale=2 ** fp16.get("initial_scale_power", 16), scale_window=fp16.get("loss_scale_window", 1000),
                   min_scale=fp16.get("min_loss_scale", 1), delayed_shift=fp16.get("hysteresis", 2),
                   consecutive_hysteresis=fp16.get("consecutive_hysteresis", False), growth_test=growth_test)

    def _grows(self) -> bool:
        if self.growth_test == "modulo":
            return (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0
        stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
        return stable_interval > 0 and stable_interval % self.scale_window == 0

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if self._grows():
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


# --- the model zoo's closing table (tests/backend_*/test_zoo.py, one line per model and dtype) ---

ZOO_HEADER = ("model", "compute", "layers", "recognised kinds", "norm+emb by class", "of them pinned",
              "rows pinned", "rows checked", "mismatches", "mismatches, no rules")


def zoo_line(name: str, compute: str, got: dict, bare: dict) -> tuple[str, ...]:
    """One table line from a zoo run with the rules (``got``) and one without (``bare``)."""
    kinds = " ".join(f"{k}:{v}" for k, v in sorted(got["kinds"].items()))
    counted = len(got["expected_pinned"])
    return (name, compute, str(got["layers"]), kinds, str(counted), str(counted - len(got["unpinned"])),
            str(got["pinned"]), str(got["checked"]), str(len(got["mismatches"])), str(len(bare["mismatches"])))


@contextlib.contextmanager
def jax_device_reads() -> Iterator[dict[str, int]]:
    """Counts, while inside, what makes the host wait for or read a JAX device: array values read
    (``float``, ``np.asarray``, ``device_get`` ...), asynchronous copies to the host and
    ``block_until_ready`` (the monitors' exact counts, in tests and benchmarks).

    Example (with JAX installed; the core's doctests run without it)::

        with jax_device_reads() as counts:
            float(jnp.ones(()))
        assert counts["read"] == 1
    """
    import functools

    import jax
    import jax.numpy as jnp

    kind = type(jnp.zeros(()))
    counts = {"read": 0, "copy_to_host_async": 0, "block_until_ready": 0}
    value, copy, block = kind._value, kind.copy_to_host_async, kind.block_until_ready

    def counted(name, fn):
        def run(self, *a, **k):
            counts[name] += 1
            return fn(self, *a, **k)
        return run

    wait = jax.block_until_ready
    # private: jaxlib's ArrayImpl._value (float(), np.asarray, device_get all read through it; jax 0.10.2)
    kind._value = property(counted("read", value.fget))
    kind.copy_to_host_async = counted("copy_to_host_async", copy)
    kind.block_until_ready = counted("block_until_ready", block)
    jax.block_until_ready = functools.partial(counted("block_until_ready", lambda _, x: wait(x)), None)
    try:
        yield counts
    finally:
        kind._value, kind.copy_to_host_async, kind.block_until_ready = value, copy, block
        jax.block_until_ready = wait


def deepspeed_fp16() -> bool:
    """Whether DeepSpeed builds a float16 engine on this machine: its CPU accelerator accepts
    float16 only where torch's oneDNN has float16 kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``:
    true on the Intel VMs, false on the AMD ones) and otherwise refuses the engine with a ValueError."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


# --- the differential fuzzers' example counts (tests/**/test_fuzz*.py; `make fuzz` sets AMPBRIDGE_FUZZ=1) ---

def tune_batches(n: int = 4) -> list:
    """``n`` float32 ``(x, tanh(x @ w))`` regression batches of 16 x 4 (NumPy, seed 1): the data the
    Keras, tf.keras 2 and Flax ``tune`` tests train on (torch's draws the same shapes from torch's RNG)."""
    import numpy as np

    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 1)).astype("float32")
    out = []
    for _ in range(n):
        x = rng.standard_normal((16, 4)).astype("float32")
        out.append((x, np.tanh(x @ w)))
    return out


def fuzzing() -> bool:
    """Whether this run is a fuzzing run (``AMPBRIDGE_FUZZ`` set to anything but ``""`` or ``0``)."""
    return os.environ.get("AMPBRIDGE_FUZZ", "") not in ("", "0")


def fuzz_settings(default: int, fuzz: int, **overrides: object) -> object:
    """hypothesis ``settings`` for a differential property: ``default`` examples, the same ones every
    run (``derandomize``, no example database), in ``make test``; ``fuzz`` fresh random examples,
    failures kept in hypothesis's database, under ``AMPBRIDGE_FUZZ=1`` (``make fuzz``). No deadline:
    the first example of a property pays for tracing and compiling.

    Example (with hypothesis installed)::

        @fuzz_settings(20, 2000)
        @given(st.integers())
        def test_something(n): ...
    """
    from hypothesis import HealthCheck, settings

    deep = fuzzing()
    options: dict = {"max_examples": fuzz if deep else default, "derandomize": not deep, "deadline": None,
                     "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                               HealthCheck.filter_too_much],
                     "print_blob": True}
    if not deep:
        options["database"] = None
    options.update(overrides)
    return settings(**options)


def lowered_ops(stablehlo_text: str) -> "collections.Counter[str]":
    """The operations of a lowered (StableHLO) program, by name, less the function frame."""
    import collections

    ops = re.findall(r"\b((?:stablehlo|chlo|mhlo|func|sdy)\.\w+)", stablehlo_text)
    return collections.Counter(op for op in ops if op not in ("func.func", "func.return"))


@contextlib.contextmanager
def aten_op_counts() -> Iterator["collections.Counter[str]"]:
    """The ATen ops torch dispatches inside the block, by name (a Counter, filled as they run)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    ops: collections.Counter[str] = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        yield ops


def compiled_instructions(hlo_text: str) -> int:
    """The instructions of an optimised HLO module (every computation, fusions' bodies included)."""
    return sum(1 for line in hlo_text.splitlines() if re.match(r"\s*(?:ROOT\s+)?%[\w.\-]+ = ", line))


# what an optimised HLO module's ENTRY lists without launching anything
_NOT_KERNELS = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start", "copy-done")


def compiled_kernels(hlo_text: str) -> int:
    r"""Kernels a compiled XLA step runs: its optimised module's ENTRY instructions (each fusion,
    dot, custom call or loop is one), less those that launch none. Counted by the JAX benchmark and
    held by tests/backend_jax/test_step_counts.py.

    Example:
        >>> compiled_kernels("ENTRY %main {\n  %p = f32[] parameter(0)\n  ROOT %f = f32[] fusion(%p)\n}")
        1
    """
    entry = hlo_text[hlo_text.index("ENTRY"):]
    body = entry[entry.index("{") + 1:entry.index("\n}")]
    ops = re.findall(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = [^=]*?\b([a-z][\w\-]*)\(", body, flags=re.M)
    return sum(1 for op in ops if op not in _NOT_KERNELS)
