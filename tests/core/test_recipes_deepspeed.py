"""A converted DeepSpeed recipe, run through the core reference, follows DeepSpeed's own scaler.

The oracle is DeepSpeed's ``DynamicLossScaler.update_scale`` transcribed
(``ampbridge._testing.DeepSpeedDynamicLossScaler``) in its two growth tests: the modulo one of
DeepSpeed 0.17.0 and earlier and the stable_interval one of 0.17.1 and later (PR 6976, e440506),
which the conversion matches with ``first_growth_interval = window + 1``. The installed 0.19.8's own scaler is
driven in tests/backend_torch/test_recipes_real_tools.py.
"""

import json
from pathlib import Path

import pytest

from ampbridge import LossScaleError, initial_state, next_state, trajectory
from ampbridge import recipes
from ampbridge._testing import DeepSpeedDynamicLossScaler

HERE = Path(__file__).parent / "recipes"


def overflow_sequence():
    """A fixed run: lone overflows the hysteresis absorbs, bursts that back off, long clean stretches."""
    seq = [True]                      # absorbed (hysteresis 2 -> 1)
    seq += [False] * 999 + [False]    # the 1000th clean step grows (and refills hysteresis)
    seq += [True, True, True]         # one absorbed, two back off
    seq += [False] * 2500             # two growths
    seq += [True, False, True]        # absorbed, clean, back off (hysteresis not refilled without growth)
    seq += [False] * 1000 + [True] * 5 + [False] * 3000
    return seq


def paired(config, seq, release="modulo"):
    policy = recipes.from_deepspeed(config, release=release).result
    cfg = policy.resolved_loss_scale
    ds = DeepSpeedDynamicLossScaler.from_config(config, release)
    state = initial_state(cfg)
    pairs = []
    for found_inf in seq:
        try:
            ds.update_scale(found_inf)
        except Exception:  # DeepSpeed exits at the minimum: so must the converted policy, at the same step
            with pytest.raises(LossScaleError):
                next_state(cfg, state, found_inf)
            pairs.append(("raised", "raised"))
            break
        state = next_state(cfg, state, found_inf)
        pairs.append(((state.scale, state.hysteresis_left), (ds.cur_scale, ds.cur_hysteresis)))
    return pairs


@pytest.mark.parametrize("file", ["ds_fp16_dynamic.json", "ds_zero2_hf_auto.json"])
def test_converted_recipe_follows_deepspeeds_trajectory(file):
    config = json.loads((HERE / file).read_text())
    if config["fp16"]["enabled"] == "auto":
        config["fp16"]["enabled"] = True  # what the Trainer fills in with --fp16
    pairs = paired(config, overflow_sequence())
    assert [ours for ours, _ in pairs] == [theirs for _, theirs in pairs]
    scales = [ours[0] for ours, _ in pairs]
    assert scales[0] == 65536.0 and scales[1000] == 131072.0  # absorbed, then grown after 1000 clean steps
    assert min(scales) < 65536.0 < max(scales)  # the sequence backs off and grows


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis,window", [(1, 3), (2, 5), (3, 4), (4, 1), (2, 50)])
def test_short_windows_and_hysteresis(consecutive, hysteresis, window):
    """Overflows as training makes them: a step overflows when scale x gradient passes float16's range."""
    import random

    rng = random.Random(hysteresis * 100 + window)
    config = {"fp16": {"enabled": True, "initial_scale_power": 20, "loss_scale_window": window,
                       "hysteresis": hysteresis, "consecutive_hysteresis": consecutive, "min_loss_scale": 1},
              "zero_optimization": {"stage": 3}}
    cfg = recipes.from_deepspeed(config, release="modulo").result.resolved_loss_scale
    ds, state = DeepSpeedDynamicLossScaler.from_config(config), initial_state(cfg)
    seq, scales = [], set()
    for _ in range(5000):
        found_inf = ds.cur_scale * rng.lognormvariate(-8, 3) > 65504.0
        seq.append(found_inf)
        ds.update_scale(found_inf)
        state = next_state(cfg, state, found_inf)
        assert (state.scale, state.hysteresis_left) == (ds.cur_scale, ds.cur_hysteresis), len(seq)
        scales.add(state.scale)
    assert 0.01 < sum(seq) / len(seq) < 0.8 and len(scales) >= 4  # overflows both absorbed and backed off


def test_minimum_scale_raises_at_the_same_step():
    config = {"fp16": {"enabled": True, "initial_scale_power": 3, "hysteresis": 2, "min_loss_scale": 1},
              "zero_optimization": {"stage": 2}}
    cfg = recipes.from_deepspeed(config, release="modulo").result.resolved_loss_scale
    assert cfg.on_min_scale == "error"
    ds, state = DeepSpeedDynamicLossScaler.from_config(config), initial_state(cfg)
    for step, found_inf in enumerate([True] * 10):
        try:
            ds.update_scale(found_inf)
        except Exception:
            with pytest.raises(LossScaleError):
                next_state(cfg, state, found_inf)
            break
        state = next_state(cfg, state, found_inf)
    assert step == 4  # one absorbed, 8 -> 4 -> 2 -> 1, then DeepSpeed exits


def test_the_later_release_grows_one_step_later_and_the_conversion_follows_it():
    """0.17.1 and later: first_growth_interval = window + 1, exact (issue 38; before, a loss)."""
    config = json.loads((HERE / "ds_fp16_dynamic.json").read_text())
    conversion = recipes.from_deepspeed(config)  # today's release
    assert conversion.losses == ()
    cfg = conversion.result.resolved_loss_scale
    assert (cfg.growth_interval, cfg.first_growth_interval) == (1000, 1001)
    seq = overflow_sequence()
    pairs = paired(config, seq, release="stable_interval")
    assert [ours for ours, _ in pairs] == [theirs for _, theirs in pairs]
    # the later release grows on the 1001st clean step, which overflows here, so its hysteresis
    # is never refilled either: the modulo release's trajectory differs from step 1000 on
    modulo = paired(config, seq)
    assert next(i for i, (a, b) in enumerate(zip(pairs, modulo)) if a[1] != b[1]) == 1000
    assert pairs[1000][1] == (65536, 1) and pairs[1001][1] == (32768.0, 1)
    assert modulo[1000][1] == (131072.0, 2)


def test_static_scale_recipe_keeps_its_scale_and_skips():
    policy = recipes.load(HERE / "ds_fp16_static.json").result
    states = trajectory(policy.resolved_loss_scale, [False, True, False, True])
    assert {s.scale for s in states} == {128.0} and states[-1].skipped == 2


def test_hysteresis_without_a_zero_stage_is_a_named_loss_and_the_stage_given_is_written(tmp_path, capsys):
    # a config without zero_optimization runs at stage 0 (FP16_Optimizer), which ignores fp16.hysteresis
    import ampbridge
    from ampbridge.cli.commands import main
    from ampbridge.recipes import from_deepspeed, to_deepspeed

    policy = ampbridge.loads('version = 1\nextends = "mixed_float16"\n[loss_scale]\nhysteresis = 2\n', format="toml")
    unknown = to_deepspeed(policy)
    assert "zero_optimization" not in unknown.result
    assert any(str(loss).startswith("loss_scale.hysteresis = 2: honoured only under ZeRO") for loss in unknown.losses)
    staged = to_deepspeed(policy, stage=2)
    assert staged.result["zero_optimization"] == {"stage": 2}
    assert not any(str(loss).startswith("loss_scale.hysteresis") for loss in staged.losses)
    assert from_deepspeed(staged.result).result.loss_scale.hysteresis == 2  # read back at the stage written
    at_zero = to_deepspeed(policy, stage=0)
    assert any(str(loss).startswith("loss_scale.hysteresis = 2: FP16_Optimizer") for loss in at_zero.losses)

    src = tmp_path / "amp.toml"
    src.write_text(ampbridge.dumps(policy, format="toml"))
    out = tmp_path / "ds.json"
    assert main(["convert", str(src), "--to", "deepspeed", "--strict", "-o", str(out)]) == 1
    assert "honoured only under ZeRO" in capsys.readouterr().err and not out.exists()
    main(["convert", str(src), "--to", "deepspeed", "--zero-stage", "2", "-o", str(out)])
    assert json.loads(out.read_text())["zero_optimization"] == {"stage": 2}
