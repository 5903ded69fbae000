"""Recipes checked against the real tools, not transcriptions: DeepSpeed 0.19.8's own loss scalers and
config loader, Accelerate 1.16's DeepSpeedPlugin and Accelerator, Lightning 2.6's connectors, torch's
GradScaler kernel. Each is driven on CPU and compared with ampbridge's reference for the converted policy.

DeepSpeed's scalers are the real classes: ZeRO's ``DynamicLossScaler`` (built by ``CreateLossScaler``
from the real ``DeepSpeedConfig``) and ``FP16_Optimizer._update_scale`` / ``FP16_UnfusedOptimizer``'s
(called on the real ``LossScaleConfig``, without building the optimizer, which wants an accelerator).
``DynamicLossScaler.update_scale`` asks ``deepspeed.comm`` for the rank only to decide who logs; that
lookup is replaced by rank 0, the scale arithmetic is DeepSpeed's.
"""

from __future__ import annotations

import os
import random
import types
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ampbridge import LossScaleError, PolicyError, initial_state, next_state, recipes
from ampbridge._testing import require

torch = require("torch")
deepspeed = require("deepspeed", "the DeepSpeed recipe checks drive its own loss scalers")
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402
from deepspeed.runtime.fp16 import loss_scaler as ds_loss_scaler  # noqa: E402
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer  # noqa: E402
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer  # noqa: E402

STEPS = 10_000


@pytest.fixture(autouse=True)
def rank_zero(monkeypatch):
    monkeypatch.setattr(ds_loss_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 0))


def test_installed_release_is_the_one_read_by_default():
    assert deepspeed.__version__ == recipes.DEEPSPEED_VERSION == "0.19.8"
    from ampbridge.recipes import tool_releases

    assert require("accelerate").__version__ == tool_releases.ACCELERATE_CURRENT
    assert require("lightning").__version__ == tool_releases.LIGHTNING_CURRENT


def test_lightning_release_rules_are_dated_by_its_own_changelog():
    """The PRs tool_releases cites are in the sections of the CHANGELOG.md the installed Lightning ships."""
    import pathlib
    import re

    root = pathlib.Path(require("lightning").__file__).parent

    def section(part, release):
        text = (root / part / "CHANGELOG.md").read_text()
        return re.search(rf"^## \[{re.escape(release)}\].*?(?=^## \[)", text, re.S | re.M)[0]

    assert "#10033" in section("pytorch", "1.5.0") and "#9049" in section("pytorch", "1.5.0")
    assert "#16783" in section("pytorch", "2.0.0") and "#16767" in section("fabric", "2.0.0")
    assert "#18193" in section("pytorch", "2.1.0") and "#17287" in section("fabric", "2.1.0")


def overflows(seed: int, rate: float) -> list[bool]:
    rng = random.Random(seed)
    seq = []
    while len(seq) < STEPS:  # bursts, lone overflows and long clean stretches
        r = rng.random()
        seq += [True] * rng.randint(1, 4) if r < rate else [False] * rng.randint(1, 60)
    return seq[:STEPS]


def reference(policy, seq):
    cfg, state, scales = policy.resolved_loss_scale, None, []
    state = initial_state(cfg)
    grows = None
    for i, found_inf in enumerate(seq):
        try:
            new = next_state(cfg, state, found_inf)
        except LossScaleError:
            scales.append("raised")
            break
        if grows is None and new.scale > state.scale:
            grows = i
        state = new
        scales.append(state.scale)
    return scales, grows


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


ZERO_CONFIGS = [
    {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    {"initial_scale_power": 12, "loss_scale_window": 50, "hysteresis": 1, "min_loss_scale": 1},
    {"initial_scale_power": 20, "loss_scale_window": 20, "hysteresis": 3, "consecutive_hysteresis": True,
     "min_loss_scale": 4},
    {"initial_scale_power": 10, "loss_scale_window": 7, "hysteresis": 2, "min_loss_scale": 1},
]


def run_both(config, seed, rate, real=None, optimizer=FP16_Optimizer):
    """The real scaler and ampbridge's reference for the converted config, step by step over STEPS
    steps whose overflows come as training makes them: a step overflows when the real scale times a
    gradient draw passes float16's range, or at random (rate). Returns (ours, theirs, sequence):
    (scale, hysteresis left) per step under ZeRO, the scale alone for FP16_Optimizer (``real`` a
    LossScaleConfig there); "raised" where DeepSpeed exits at the minimum."""
    ds_cfg = DeepSpeedConfig(config).float16_config  # the real config loader: defaults, validation
    zero = real is None
    if zero:
        real = ds_loss_scaler.CreateLossScaler(torch.half, ds_cfg.loss_scale, True, ds_cfg.dynamic_loss_scale_args())
        assert type(real) is ds_loss_scaler.DynamicLossScaler
        read, update = (lambda: (float(real.cur_scale), int(real.cur_hysteresis))), real.update_scale
    else:
        fake = types.SimpleNamespace(loss_scale_config=real, verbose=False)
        read, update = (lambda: float(real.cur_scale)), (lambda found: optimizer._update_scale(fake, found))
    conversion = recipes.from_deepspeed(config)
    assert conversion.exact, conversion.losses
    cfg = conversion.result.resolved_loss_scale
    rng, state, ours, theirs, seq = random.Random(seed), initial_state(cfg), [], [], []
    for _ in range(STEPS):
        scale = read()[0] if zero else read()
        found_inf = rng.random() < rate or scale * rng.lognormvariate(-9.0, 2.5) > 65504.0
        seq.append(found_inf)
        try:
            update(found_inf)
            theirs.append(read())
        except Exception:
            theirs.append("raised")
        try:
            state = next_state(cfg, state, found_inf)
            ours.append((state.scale, state.hysteresis_left) if zero else state.scale)
        except LossScaleError:
            ours.append("raised")
        if "raised" in (ours[-1], theirs[-1]):
            break
    return ours, theirs, seq


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("fp16", ZERO_CONFIGS)
def test_zero_dynamic_loss_scaler_equals_the_conversion(fp16, seed):
    """ZeRO 1-3: the real DynamicLossScaler's scale and hysteresis equal ampbridge's for the converted
    config at every step (first_growth_interval = window + 1, issue 38); read for 0.17.0 (the last release
    whose growth test is every window) the two part exactly at the first growth."""
    config = {"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": 0, **fp16},
              "zero_optimization": {"stage": 2}}
    assert recipes.from_deepspeed(config).result.loss_scale.first_growth_interval == fp16["loss_scale_window"] + 1
    ours, theirs, seq = run_both(config, seed, rate=0.001 * seed)
    assert ours == theirs
    assert len({pair[0] for pair in theirs if pair != "raised"}) > 2  # backed off and grown
    old, first_growth = reference(recipes.from_deepspeed(config, version="0.17.0").result, seq)
    assert first_difference(old, [t if t == "raised" else t[0] for t in theirs]) == first_growth


#: 17 overflow sequences x 10,000 steps: (seed, random-overflow rate, fp16 section)
SEQUENCES = [(100 + i, (0.0, 0.0005, 0.001, 0.002, 0.004)[i % 5], ZERO_CONFIGS[i % len(ZERO_CONFIGS)])
             for i in range(17)]


def _calls_create_loss_scaler(cls):
    import inspect

    return "CreateLossScaler(" in inspect.getsource(cls.__init__)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_follows_the_real_scaler_over_17_sequences(stage):
    """DeepSpeed 0.19.8, per ZeRO stage, the scaler that stage really uses: 1 and 2 build theirs in
    DeepSpeedZeroOptimizer.__init__ (stage_1_and_2.py), 3 in DeepSpeedZeroOptimizer_Stage3.__init__
    (stage3.py), both with CreateLossScaler from the engine's dynamic_loss_scale_args; 0 (no ZeRO) runs
    FP16_Optimizer._update_scale (no hysteresis). Driven directly, 17 sequences x 10,000 steps each:
    the converted config's scale (and, under ZeRO, hysteresis) equals the real one's at every step."""
    if stage:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        assert _calls_create_loss_scaler(DeepSpeedZeroOptimizer_Stage3 if stage == 3 else DeepSpeedZeroOptimizer)
    steps, overflowed, grown = 0, 0, 0
    for seed, rate, fp16 in SEQUENCES:
        config = {"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": 0, **fp16},
                  "zero_optimization": {"stage": stage}}
        real = None
        if not stage:
            ds_cfg = DeepSpeedConfig(config).float16_config
            real = ds_loss_scaler.LossScaleConfig(torch.float16, True, ds_cfg.loss_scale,
                                                  ds_cfg.dynamic_loss_scale_args(),
                                                  initial_dynamic_scale=ds_cfg.initial_dynamic_scale())
        ours, theirs, seq = run_both(config, seed, rate, real)
        assert ours == theirs, (seed, next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b))
        steps, overflowed = steps + len(theirs), overflowed + sum(seq)
        scales = [t[0] if stage else t for t in theirs if t != "raised"]
        grown += sum(b > a for a, b in zip(scales, scales[1:]))
    # one sequence (window 1000, a random overflow every ~250 steps) decays to the minimum, where ZeRO
    # exits and ampbridge raises at the same step (FP16_Optimizer clamps instead and runs on)
    assert steps >= (17 if stage == 0 else 16) * STEPS and overflowed > 1000 and grown > 1000


def drive_zero(real, seq):
    """(scale, hysteresis left) of the real ZeRO scaler after each step; "raised" where it exits."""
    out = []
    for found_inf in seq:
        try:
            real.update_scale(found_inf)
        except Exception:
            out.append("raised")
            break
        out.append((float(real.cur_scale), int(real.cur_hysteresis)))
    return out


def reference_pairs(policy, seq, hysteresis=True):
    cfg = policy.resolved_loss_scale
    state, out = initial_state(cfg), []
    for found_inf in seq:
        try:
            state = next_state(cfg, state, found_inf)
        except LossScaleError:
            out.append("raised")
            break
        out.append((state.scale, state.hysteresis_left) if hysteresis else state.scale)
    return out


@settings(max_examples=300 if os.environ.get("AMPBRIDGE_FUZZ") else 60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.booleans(), st.integers(2, 12), st.integers(1, 4),
       st.sampled_from([0, 1, 2, 3]), st.lists(st.booleans(), min_size=1, max_size=300))
def test_the_real_scaler_matches_any_converted_config(window, hysteresis, consecutive, power, floor, stage, seq):
    """The property behind first_growth_interval: for random DeepSpeed fp16 settings, ZeRO stage and
    overflow sequence, the real 0.19.8 scaler of that stage and the converted config agree at every step."""
    config = {"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": power, "loss_scale_window": window,
                                              "hysteresis": hysteresis, "consecutive_hysteresis": consecutive,
                                              "min_loss_scale": floor}, "zero_optimization": {"stage": stage}}
    ds_cfg = DeepSpeedConfig(config).float16_config
    conversion = recipes.from_deepspeed(config)
    assert conversion.exact
    if stage:
        real = ds_loss_scaler.CreateLossScaler(torch.half, 0, True, ds_cfg.dynamic_loss_scale_args())
        theirs = drive_zero(real, seq)
    else:
        state = ds_loss_scaler.LossScaleConfig(torch.float16, True, ds_cfg.loss_scale, ds_cfg.dynamic_loss_scale_args(),
                                               initial_dynamic_scale=ds_cfg.initial_dynamic_scale())
        fake = types.SimpleNamespace(loss_scale_config=state, verbose=False)
        theirs = []
        for found_inf in seq:
            FP16_Optimizer._update_scale(fake, found_inf)
            theirs.append(float(state.cur_scale))
    assert reference_pairs(conversion.result, seq, hysteresis=bool(stage)) == theirs


def test_clean_run_grows_where_deepspeed_does():
    config = {"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 25},
              "zero_optimization": {"stage": 3}}
    ds_cfg = DeepSpeedConfig(config)
    real = ds_loss_scaler.CreateLossScaler(torch.half, 0, True, ds_cfg.float16_config.dynamic_loss_scale_args())
    theirs = []
    for _ in range(60):
        real.update_scale(False)
        theirs.append(float(real.cur_scale))
    ours, first_growth = reference(recipes.from_deepspeed(config).result, [False] * 60)
    assert ours == theirs and first_growth + 1 == 26  # the 26th clean step: window + 1
    assert theirs[24:27] == [256.0, 512.0, 512.0] and theirs[50] == 1024.0  # later growths every window


def test_zero_raises_at_the_minimum_at_the_same_step():
    config = {"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 3, "hysteresis": 2,
                                              "min_loss_scale": 1}, "zero_optimization": {"stage": 1}}
    real = ds_loss_scaler.CreateLossScaler(torch.half, 0, True,
                                           DeepSpeedConfig(config).float16_config.dynamic_loss_scale_args())
    ours, _ = reference(recipes.from_deepspeed(config).result, [True] * 10)
    for step in range(10):
        try:
            real.update_scale(True)
        except Exception:
            break
    assert ours[step] == "raised" and len(ours) == step + 1 == 5


@pytest.mark.parametrize("optimizer,profile", [(FP16_Optimizer, ds_loss_scaler.LossScaleProfile.FUSED),
                                               (FP16_UnfusedOptimizer, ds_loss_scaler.LossScaleProfile.UNFUSED)])
@pytest.mark.parametrize("seed", [4, 5])
def test_fp16_without_zero_has_no_hysteresis(optimizer, profile, seed):
    """No ZeRO: FP16_Optimizer / FP16_UnfusedOptimizer ignore hysteresis (read as 1) and grow first after
    window + 1 finite steps (first_growth_interval): the trajectories agree at every step."""
    config = {"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 14, "loss_scale_window": 40,
                                              "hysteresis": 2, "min_loss_scale": 1}}
    ds_cfg = DeepSpeedConfig(config).float16_config
    state = ds_loss_scaler.LossScaleConfig(torch.float16, True, ds_cfg.loss_scale, ds_cfg.dynamic_loss_scale_args(),
                                           profile=profile, initial_dynamic_scale=ds_cfg.initial_dynamic_scale())
    conversion = recipes.from_deepspeed(config)
    assert conversion.result.loss_scale.hysteresis == 1 and conversion.result.loss_scale.on_min_scale == "clamp"
    assert conversion.exact and conversion.result.loss_scale.first_growth_interval == 41
    ours, theirs, seq = run_both(config, seed, 0.01, state, optimizer)
    assert ours == theirs and len(theirs) == STEPS
    steps = list(zip(theirs, theirs[1:]))
    assert any(b < a for a, b in steps) and any(b > a for a, b in steps)  # backed off and grown
    # the old reading (hysteresis 2) parted at the first overflow
    old = conversion.result.replace(loss_scale=conversion.result.loss_scale.replace(hysteresis=2))
    assert first_difference(reference(old, seq)[0], theirs) == seq.index(True)


def test_config_loader_agrees_with_the_reading():
    """The real DeepSpeedConfig: check_grad_overflow's default, the refused communication dtype."""
    cfg = DeepSpeedConfig({"train_batch_size": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    assert cfg.bfloat16_config.check_grad_overflow is True
    assert recipes.from_deepspeed({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}).result \
        .loss_scale.skip_nonfinite is True
    with pytest.raises(ValueError, match="communication_data_type"):
        DeepSpeedConfig({"train_batch_size": 1, "bf16": {"enabled": True}, "communication_data_type": "bfp16"})
    with pytest.raises(PolicyError, match="communication_data_type"):
        recipes.from_deepspeed({"bf16": {"enabled": True}, "communication_data_type": "bfp16"})


@pytest.mark.parametrize("precision", ["bf16", "fp16", "no"])
def test_accelerate_deepspeed_plugin_fills_the_config_as_read(precision):
    """transformers' ds_config_zero2.json has no fp16/bf16 section: DeepSpeedPlugin.set_mixed_precision adds one."""
    accelerate_utils = require("accelerate.utils")
    config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
    plugin = accelerate_utils.DeepSpeedPlugin(hf_ds_config=dict(config))
    plugin.set_mixed_precision(precision)
    filled = recipes.from_deepspeed(plugin.deepspeed_config)
    read = recipes.from_deepspeed(config, auto=precision)
    assert read.result == filled.result
    assert read.result.compute_dtype == {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}[precision]


def test_accelerate_raises_where_the_reading_refuses():
    accelerate_utils = require("accelerate.utils")
    plugin = accelerate_utils.DeepSpeedPlugin(hf_ds_config={"fp16": {"enabled": True},
                                                            "zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="cannot be set to `bf16`"):
        plugin.set_mixed_precision("bf16")
    with pytest.raises(PolicyError, match="Accelerate raises"):
        recipes.from_deepspeed({"fp16": {"enabled": True}}, auto="bf16")


def test_accelerate_fp16_on_cpu_runs_float32_as_read():
    require("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    try:
        acc = Accelerator(cpu=True, mixed_precision="fp16")
        model = acc.prepare(torch.nn.Linear(4, 4))
        layer_out = torch.nn.functional.linear(torch.randn(2, 4), model.weight)  # what the model computes in
        with acc.autocast():
            inside = torch.mm(torch.randn(2, 4), torch.randn(4, 4))
    finally:
        AcceleratorState._reset_state(True)
    policy = recipes.from_accelerate({"mixed_precision": "fp16"}, device="cpu").result
    assert acc.scaler is None and inside.dtype == layer_out.dtype == torch.float32
    assert policy.compute_dtype == "float32" and policy.loss_scale.mode == "none"
    assert recipes.from_accelerate({"mixed_precision": "fp16"}).result.compute_dtype == "float16"  # CUDA's


@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_lightning_16_mixed_on_cpu_is_bf16_mixed_as_read(api):
    require("lightning")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if api == "trainer":
            from lightning.pytorch import Trainer

            plugin = Trainer(accelerator="cpu", precision="16-mixed", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False).precision_plugin
        else:
            from lightning.fabric import Fabric

            plugin = Fabric(accelerator="cpu", precision="16-mixed")._precision
    policy = recipes.from_lightning("16-mixed", device="cpu", api=api).result
    assert plugin.precision == "bf16-mixed" and getattr(plugin, "scaler", None) is None
    assert policy.compute_dtype == "bfloat16" and policy.loss_scale.mode == "none"


def test_lightning_trainer_returns_bf16_outputs_and_fabric_float32():
    require("lightning")
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    seen = {}

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.layer(x)

        def training_step(self, batch, _):
            out = self(batch)
            seen["trainer"] = out.dtype
            return out.float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Module(), torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2))
        fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
        seen["fabric"] = fabric.setup(torch.nn.Linear(4, 4))(torch.randn(2, 4)).dtype
    assert (seen["trainer"], seen["fabric"]) == (torch.bfloat16, torch.float32)
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    assert recipes.from_lightning("bf16-mixed", api="trainer").result.output_dtype == name[seen["trainer"]]
    assert recipes.from_lightning("bf16-mixed", api="fabric").result.output_dtype == name[seen["fabric"]]
    assert [loss.setting for loss in recipes.from_lightning("bf16-mixed").losses] == ["output_dtype"]


def test_torch_grad_scaler_factor_parts_where_the_loss_says():
    """torch's _amp_update_scale_ (the GradScaler kernel) multiplies by the double factor."""
    scale, tracker = torch.tensor([65536.0]), torch.tensor([0], dtype=torch.int32)
    found = torch.tensor([0.0])
    theirs = []
    for _ in range(10):
        torch._amp_update_scale_(scale, tracker, found, 1.1, 0.5, 1)
        theirs.append(scale.item())
    policy = recipes.from_accelerate({"mixed_precision": "fp16"},
                                     grad_scaler_kwargs={"growth_factor": 1.1, "growth_interval": 1})
    ours, _ = reference(policy.result, [False] * 10)
    n = first_difference(ours, theirs) + 1
    assert f"growth number {n} ({theirs[n - 1]!r} in torch, {ours[n - 1]!r} here)" in policy.losses[0].reason
    # written the other way, the float32 factor makes torch follow ampbridge exactly
    args = recipes.to_grad_scaler(policy.result).result
    scale, tracker = torch.tensor([65536.0]), torch.tensor([0], dtype=torch.int32)
    written = []
    for _ in range(10):
        torch._amp_update_scale_(scale, tracker, found, args["growth_factor"], args["backoff_factor"], 1)
        written.append(scale.item())
    assert written == ours


# --- the NaN-step table, from real DeepSpeed engines ----------------------------------------------------

_ENGINES = r'''
import json, logging, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch
import deepspeed
from deepspeed.utils import logger
logger.setLevel(logging.ERROR)
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # no JIT-compiled shared-memory op on CPU
deepspeed.init_distributed(dist_backend="gloo")
from deepspeed.runtime.zero.partition_parameters import GatheredParameters
for config in json.loads(sys.argv[2]):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    config = {"train_batch_size": 1, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, **config}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    dtype = next(engine.module.parameters()).dtype
    loss = engine(torch.randn(1, 8, dtype=dtype)).float().sum() * float("nan")  # every gradient NaN
    engine.backward(loss)
    engine.step()
    with GatheredParameters(list(engine.module.parameters()), enabled=config["zero_optimization"]["stage"] == 3):
        nan = any(torch.isnan(p.detach().float()).any().item() for p in engine.module.parameters())
    print("CELL", json.dumps([not nan, type(engine.optimizer).__name__]), flush=True)
'''


def test_nan_step_table_from_real_engines_agrees_with_the_reading():
    """bf16 (check_grad_overflow absent / false / true), float32 and fp16 x ZeRO 0-3, and ZeRO 1 with float32
    gradient accumulation: one NaN step on a real single-process (gloo, CPU) DeepSpeed engine each; whether the
    parameters stayed finite (the step was skipped) is what from_deepspeed reads as skip_nonfinite."""
    import json
    import socket
    import subprocess
    import sys

    from ampbridge._testing import deepspeed_fp16

    configs = []
    for precision in ({"bf16": {"enabled": True}}, {"bf16": {"enabled": True, "check_grad_overflow": False}},
                      {"bf16": {"enabled": True, "check_grad_overflow": True}}, {},
                      {"fp16": {"enabled": True, "initial_scale_power": 4}}):
        if "fp16" in precision and not deepspeed_fp16():
            continue  # DeepSpeed refuses float16 engines on this CPU (its oneDNN has no float16 kernels)
        configs += [{**precision, "zero_optimization": {"stage": stage}} for stage in range(4)]
    configs.append({"bf16": {"enabled": True, "check_grad_overflow": False}, "zero_optimization": {"stage": 1},
                    "data_types": {"grad_accum_dtype": "fp32"}})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", _ENGINES, str(port), json.dumps(configs)], capture_output=True,
                          text=True, timeout=600)
    cells = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("CELL ")]
    assert len(cells) == len(configs), done.stderr[-3000:]
    measured = [skipped for skipped, _ in cells]
    read = [recipes.from_deepspeed(config).result.loss_scale.skip_nonfinite for config in configs]
    assert read == measured, [(c, m, r, o) for c, (m, o), r in zip(configs, cells, read) if m != r]
    assert measured[4:8] == [True, False, False, True]  # check_grad_overflow: false is honoured by ZeRO 1-2 only
    assert measured[12:16] == [False, True, True, True]  # float32: only the plain optimizer applies a NaN step
    assert cells[-1] == [True, "BF16_Optimizer"]
