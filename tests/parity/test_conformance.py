"""One policy, three frameworks: the same Plan, the same loss-scale trajectory, the same training.
tf.keras 2 is a fourth column where ``tf_keras`` is installed (in this process, beside Keras 3).

The demo model (``ampbridge.cli.demo``) is defined in torch, Keras and Flax with the same layer names
and the same initial weights (one numpy seed), trained with SGD on the same batches. At the steps
in ``inject`` the loss is multiplied by inf, so those steps' gradients are non-finite in every
framework and dtype; the initial scales are small enough that no other step overflows, so the
non-finite steps are exactly the injected ones and the loss-scale trajectory is determined.
"""

from __future__ import annotations

import importlib.util
import warnings
from functools import lru_cache

import pytest

import ampbridge
from ampbridge import LossScaleConfig
from ampbridge.core.loss_scale import applies, enter_phase, initial_state, next_state
from ampbridge._testing import require, required

for _name in ("torch", "keras", "jax", "flax", "optax", "jmp", "numpy"):
    require(_name)

import numpy as np  # noqa: E402

from ampbridge.cli.demo.run import semantic_differences  # noqa: E402
from ampbridge.cli.demo.runners import FRAMEWORKS, RUNNERS  # noqa: E402

if required("tf_keras"):
    require("tf_keras")
TF_KERAS = importlib.util.find_spec("tf_keras") is not None
#: the cases tf.keras 2 refuses by name (Keras 2's LossScaleOptimizer state has no room for them)
TF_KERAS_REFUSES = {"first_growth": "first_growth_interval", "max_skips": "max_consecutive_skips"}


def columns(case: str) -> tuple[str, ...]:
    """The frameworks that run ``case``: tf_keras where installed, but not what it refuses."""
    extra = TF_KERAS and case not in TF_KERAS_REFUSES
    return FRAMEWORKS + (("tf_keras",) if extra else ())

STEPS = 50
PINS = ("kind:norm", "kind:embedding")

POLICIES = {
    # float16 + dynamic scaling, pins and an override; growth every 4 finite steps
    "float16": (ampbridge.loads(f"""
        compute_dtype = "float16"
        keep_float32 = {list(PINS)!r}
        [[override]]
        match = "head"
        compute_dtype = "float32"
        [loss_scale]
        mode = "dynamic"
        initial_scale = 1024.0
        growth_interval = 4
        """.replace("'", '"')), (7, 20, 21)),
    "bfloat16": (ampbridge.preset("mixed_bfloat16").replace(keep_float32=PINS), (11,)),
    "static": (ampbridge.preset("mixed_float16").replace(
        keep_float32=PINS, loss_scale=LossScaleConfig(mode="static", initial_scale=256.0)), (5, 6)),
    # hysteresis 2 with a floor and a ceiling: bursts are absorbed, then back off to the floor
    "hysteresis": (ampbridge.preset("mixed_float16").replace(keep_float32=PINS, loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=1024.0, growth_interval=3, hysteresis=2, min_scale=256.0,
        max_scale=4096.0)), (4, 9, 10, 11, 12, 13, 30)),
    "float32": (ampbridge.preset("float32"), (17,)),
    # DeepSpeed >= 0.17.1's growth timing: growth_interval 4, but 5 finite steps before the first
    # growth and after each overflow (a hysteresis overflow included); the scale stays <= 32768
    "first_growth": (ampbridge.preset("mixed_float16").replace(keep_float32=PINS, loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=64.0, growth_interval=4, first_growth_interval=5, hysteresis=2)),
        (9, 15, 16, 30)),
    # optax's apply_if_finite(inner, 2): the third non-finite step in a row is applied (last, so the
    # NaN it leaves in the weights ends nothing but the run)
    "max_skips": (ampbridge.preset("mixed_float16").replace(keep_float32=PINS, loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=1024.0, growth_interval=4, max_consecutive_skips=2)),
        (8, 20, 21, 46, 47, 48, 49)),
}

# issue 9's case: float32 while fragile, then float16 mixed, then float16 with the norms pinned
SCHEDULE = (ampbridge.loads("""
    compute_dtype = "float16"
    keep_float32 = ["kind:embedding"]
    [loss_scale]
    mode = "auto"
    initial_scale = 1024.0
    growth_interval = 4
    [[phase]]
    until_step = 10
    compute_dtype = "float32"
    [[phase]]
    until_step = 30
    [[phase]]
    keep_float32 = ["kind:norm", "kind:embedding"]
    [phase.loss_scale]
    growth_interval = 3
    """), (3, 15, 16, 33))

#: how far float16/bfloat16 training may drift between frameworks, relative to the loss.
#: Each framework rounds the half-precision layers' results to the format (relative error up to
#: eps/2 per rounding) but at different places (where casts sit, matmul accumulation order), so
#: per-step losses differ by a few roundings; over 50 SGD steps on this model that stays below one
#: machine epsilon of the compute dtype (measured: float16 ~0.1 eps, bfloat16 ~0.3 eps). Where
#: TensorFlow's bfloat16 kernels truncate (see keras_rounds_bfloat16_toward_zero), Keras's plain
#: run drifts further, always the same way (measured on an AVX2-only CPU: 1.7 eps).
TOLERANCE = {"float32": 1e-5, "float16": ampbridge.formats()["float16"].eps,
             "bfloat16": ampbridge.formats()["bfloat16"].eps}


@lru_cache(maxsize=None)
def run(case: str, framework: str, **options):
    policy, inject = SCHEDULE if case == "schedule" else POLICIES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return RUNNERS[framework](policy, STEPS, inject, **options)


def keras_rounds_bfloat16_toward_zero() -> bool:
    """On a CPU where TensorFlow's own bfloat16 kernels truncate (``ampbridge.keras.bfloat16_rounding``),
    Keras-on-TensorFlow bfloat16 training drifts systematically from torch and JAX, which round
    to nearest; there the losses are compared on XLA (``jit_compile=True``), which rounds to
    nearest too, and the plain run is held to the truncation bound instead."""
    import ampbridge.keras as ak

    return ak.bfloat16_rounding() == "toward zero"


def reference_scales(case: str) -> tuple[list[float], list[bool]]:
    """The scale each step uses and which steps are skipped, from the core reference alone."""
    policy, inject = SCHEDULE if case == "schedule" else POLICIES[case]
    scales, skipped, state, cfg = [], [], None, None
    for step in range(STEPS):
        active = policy.at(step=step, epoch=0)
        new_cfg = active.resolved_loss_scale
        if state is None:
            state = initial_state(new_cfg)
        elif new_cfg != cfg:
            index = policy.phase_index(step=step)
            reset = index is not None and policy.phases[index].reset_loss_scale
            state = enter_phase(new_cfg, state, previous=cfg, reset=reset)
        cfg = new_cfg
        found_inf = step in inject
        scales.append(state.scale)
        skipped.append(not applies(cfg, found_inf, state.nonfinite_streak))
        state = next_state(cfg, state, found_inf)
    return scales, skipped


CASES = list(POLICIES) + ["schedule"]


@pytest.mark.parametrize("case", CASES)
def test_plans_are_identical_row_by_row(case):
    plans = {fw: run(case, fw).plan for fw in columns(case)}
    first, promoted = plans["torch"], run(case, "torch").promoted
    for fw in columns(case)[1:]:
        # the one difference the frameworks' own semantics make: a torch block whose code meets a pinned
        # float32 output carries the promoted stream on (autocast by hand casts nothing at its boundary),
        # where Keras and Flax cast the next layer's inputs; the torch row says so
        rest, allowed = semantic_differences(first, plans[fw], promoted)
        assert rest == [], fw
        for path in allowed:
            assert (first[path].output_dtype, plans[fw][path].output_dtype) == (
                "float32", plans[fw][path].compute_dtype), (fw, path)
            assert "follows the data flow" in first[path].note
    assert promoted == ({"block"} if case in ("float16", "bfloat16", "static", "hysteresis", "first_growth", "max_skips")
                        else set())
    assert [r.path for r in first.rows] == [r.path for r in plans["jax"].rows]  # the same order too


@pytest.mark.parametrize("case", CASES)
def test_loss_scale_trajectory_and_skips_match_the_reference(case):
    scales, skipped = reference_scales(case)
    _, inject = SCHEDULE if case == "schedule" else POLICIES[case]
    # every injected step is skipped, except where max_consecutive_skips applies it
    applied_anyway = {"max_skips": {48, 49}}.get(case, set())
    assert sorted(i for i, s in enumerate(skipped) if s) == sorted(set(inject) - applied_anyway)
    for fw in columns(case):
        r = run(case, fw)
        assert r.scales == scales, fw
        assert r.skipped == skipped, fw
    finals = {fw: run(case, fw).final_state for fw in columns(case)}
    assert all(final == finals["torch"] for final in finals.values()), finals
    assert finals["torch"].steps == STEPS and finals["torch"].skipped == len(inject) - len(applied_anyway)


def test_the_schedule_switches_at_the_same_steps():
    expected = [0] * 10 + [1] * 20 + [2] * 20
    for fw in columns("schedule"):
        assert run("schedule", fw).phases == expected, fw


@pytest.mark.parametrize("case", [c for c in POLICIES])
def test_training_losses_agree(case):
    policy, inject = POLICIES[case]
    tolerance = TOLERANCE[policy.compute_dtype]
    truncating = policy.compute_dtype == "bfloat16" and keras_rounds_bfloat16_toward_zero()
    losses = {fw: np.array(run(case, fw).losses) for fw in columns(case)}
    if truncating:
        for fw in {"keras", "tf_keras"} & set(losses):
            losses[f"{fw} (TF kernels)"] = losses[fw]
            losses[fw] = np.array(run(case, fw, jit_compile=True).losses)
    finite = np.isfinite(losses["torch"])
    assert finite.sum() == STEPS - len(inject)
    for fw in losses.keys() - {"torch"}:
        assert np.array_equal(np.isfinite(losses[fw]), finite), fw
        rel = np.abs(losses[fw][finite] - losses["torch"][finite]) / np.abs(losses["torch"][finite])
        # truncation errs by up to a whole ulp per rounding, always the same way: twice the bound
        bound = 2 * tolerance if fw.endswith("(TF kernels)") else tolerance
        assert rel.max() <= bound, (fw, float(rel.max()))
    # and it really trains: the loss falls well below its starting value
    assert losses["torch"][finite][-1] < 0.5 * losses["torch"][0]



def test_where_the_frameworks_differ_the_plan_says_why():
    """Without pins, each framework's own machinery decides some layers (norms upcast inside
    Keras and Flax, autocast leaves them in their input's dtype on CPU); those rows may differ,
    and each such row carries the note that explains it. Every other row is identical."""
    policy = ampbridge.preset("mixed_float16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = {fw: RUNNERS[fw](policy, 1).plan for fw in columns("")}
    for fw in columns("")[1:]:
        for line in plans["torch"].differences(plans[fw]):
            path = line.split(":", 1)[0]
            assert path in plans["torch"] and path in plans[fw], line
            assert plans["torch"][path].note or plans[fw][path].note, line


@pytest.mark.parametrize("case", sorted(TF_KERAS_REFUSES))
def test_tf_keras_refuses_by_name_what_keras2_cannot_hold(case):
    if not TF_KERAS:
        pytest.skip("tf_keras is not installed")
    policy, inject = POLICIES[case]
    with pytest.raises(ampbridge.UnsupportedOptionError, match=TF_KERAS_REFUSES[case]):
        RUNNERS["tf_keras"](policy, 2, inject)
