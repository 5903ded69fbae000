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

import random
import types
import warnings

import pytest

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


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("fp16", ZERO_CONFIGS)
def test_zero_dynamic_loss_scaler_parts_where_the_conversion_says(fp16, seed):
    """ZeRO 1-3: the real DynamicLossScaler equals ampbridge's trajectory up to the first step where
    ampbridge grows the scale; the conversion reports exactly that difference (step window of a clean run)."""
    config = {"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": 0, **fp16},
              "zero_optimization": {"stage": 2}}
    ds_cfg = DeepSpeedConfig(config)  # the real config loader: defaults, validation
    real = ds_loss_scaler.CreateLossScaler(torch.half, ds_cfg.float16_config.loss_scale, True,
                                           ds_cfg.float16_config.dynamic_loss_scale_args())
    conversion = recipes.from_deepspeed(config)
    assert [loss.setting for loss in conversion.losses] == ["fp16.loss_scale_window"]
    window = fp16["loss_scale_window"]
    assert f"part at step {window} of a clean run" in conversion.losses[0].reason
    seq = overflows(seed, rate=0.005 if window >= 1000 else 0.02 + 0.01 * seed)
    theirs = []
    for found_inf in seq:
        try:
            real.update_scale(found_inf)
        except Exception:
            theirs.append("raised")
            break
        theirs.append(float(real.cur_scale))
    ours, first_growth = reference(conversion.result, seq)
    assert first_growth is not None, "the sequence must grow the scale"
    assert first_difference(ours, theirs) == first_growth
    assert ours[:first_growth] == theirs[:first_growth]  # hysteresis, backoff, the minimum: the same
    # read for 0.17.0 (the last release with ampbridge's growth test) the conversion is exact
    assert recipes.from_deepspeed(config, version="0.17.0").exact


def test_clean_run_parts_at_the_named_step():
    config = {"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 25},
              "zero_optimization": {"stage": 3}}
    ds_cfg = DeepSpeedConfig(config)
    real = ds_loss_scaler.CreateLossScaler(torch.half, 0, True, ds_cfg.float16_config.dynamic_loss_scale_args())
    theirs = []
    for _ in range(60):
        real.update_scale(False)
        theirs.append(float(real.cur_scale))
    ours, _ = reference(recipes.from_deepspeed(config).result, [False] * 60)
    assert first_difference(ours, theirs) + 1 == 25  # "step 25 of a clean run", counted from 1


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
    """No ZeRO: FP16_Optimizer / FP16_UnfusedOptimizer ignore hysteresis (read as 1: the trajectories
    agree through every backoff) and grow one step late (the loss, at the first growth)."""
    config = {"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 14, "loss_scale_window": 40,
                                              "hysteresis": 2, "min_loss_scale": 1}}
    ds_cfg = DeepSpeedConfig(config).float16_config
    state = ds_loss_scaler.LossScaleConfig(torch.float16, True, ds_cfg.loss_scale, ds_cfg.dynamic_loss_scale_args(),
                                           profile=profile, initial_dynamic_scale=ds_cfg.initial_dynamic_scale())
    fake = types.SimpleNamespace(loss_scale_config=state, verbose=False)
    seq = [True, False, True, True] + overflows(seed, rate=0.05)[:-4]  # backoffs first, then growth
    theirs = []
    for found_inf in seq:
        optimizer._update_scale(fake, found_inf)
        theirs.append(float(state.cur_scale))
    conversion = recipes.from_deepspeed(config)
    assert conversion.result.loss_scale.hysteresis == 1 and conversion.result.loss_scale.on_min_scale == "clamp"
    assert [loss.setting for loss in conversion.losses] == ["fp16.loss_scale_window"]
    ours, first_growth = reference(conversion.result, seq)
    assert first_growth is not None and first_difference(ours, theirs) == first_growth
    assert min(theirs[:first_growth]) < 2.0 ** 14  # backoffs happened before and agreed
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
