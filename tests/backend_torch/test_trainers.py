"""The trainers people use, on ampbridge's Plan and scaler: the real transformers ``Trainer`` (tiny
BERT and GPT-2, random init, default arguments), the real ``lightning.Trainer`` with
``lightning_precision``, and Accelerate's own loop with ``amp.step``. Each run gets an overflow at
a known step and is compared, step for step and bit for bit, with the torch.amp loop written by
hand (``torch.autocast`` float16 on CPU + ``torch.amp.GradScaler``, ``unscale_`` + ``clip_grad_norm_``)
fed the very batches the trainer fed the model (recorded by a forward pre-hook).
"""

import copy
import inspect

import pytest

import ampbridge
import ampbridge._testing
import ampbridge.core.loss_scale

torch = ampbridge._testing.require("torch")
transformers = ampbridge._testing.require("transformers")
import ampbridge.torch as abt  # noqa: E402

OVERFLOW_AT = 1  # the optimizer step whose loss is made infinite
STEPS = 4


@pytest.fixture(autouse=True)
def _quiet():
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


def tiny(kind):
    torch.manual_seed(0)
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def rows(n=16):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (8,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def instrument(model, overflow_call, record=None):
    """Make the loss of the ``overflow_call``-th training forward infinite; record the kwargs fed."""
    calls = [0]

    def poison(module, args, kwargs, out):
        if module.training:
            if calls[0] == overflow_call:
                out["loss"] = out["loss"] * float("inf")
            calls[0] += 1
        return out

    model.register_forward_hook(poison, with_kwargs=True)
    if record is not None:
        model.register_forward_pre_hook(
            lambda m, a, kw: record.append({k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()}),
            with_kwargs=True)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(got, want, step):
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"step {step}: {len(differ)} tensors differ from the hand-written loop, e.g. {differ[:3]}"


def hand_loop(model, fed, micro, *, max_norm, make_optimizer, make_scheduler=None):
    """torch.amp written by hand: ``micro`` forwards per optimizer step, the scheduler stepped only
    when the step was applied (the usual check: the scale did not go down)."""
    instrument(model, OVERFLOW_AT * micro)
    opt = make_optimizer(model)
    sched = make_scheduler(opt) if make_scheduler else None
    scaler = torch.amp.GradScaler("cpu")
    model.train()
    after = []
    for start in range(0, len(fed), micro):
        for kwargs in fed[start:start + micro]:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**kwargs).loss
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if max_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if sched is not None and scaler.get_scale() >= before:
            sched.step()
        opt.zero_grad()
        after.append((snapshot(model), scaler.get_scale(), sched.get_last_lr()[0] if sched else None))
    return after


# --- forward signature ---------------------------------------------------------------------------

def test_apply_keeps_the_forward_signature():
    model = tiny("gpt2")
    want = inspect.signature(model.forward)
    block_want = inspect.signature(model.transformer.h[0].forward)
    amp = abt.apply(model, ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm", "transformer.h.0")))
    assert "forward" in model.__dict__ and "forward" in model.transformer.h[0].__dict__  # both wrapped
    assert inspect.signature(amp.model.forward) == want
    assert inspect.signature(model.transformer.h[0].forward) == block_want
    assert model.forward.__wrapped__ == type(model).forward.__get__(model)
    assert "input_ids" in want.parameters and "labels" in want.parameters
    # what the Trainer reads: the columns it keeps, and whether the model takes loss kwargs
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
    amp.remove()
    assert inspect.signature(model.forward) == want


# --- Hugging Face Trainer ------------------------------------------------------------------------

def trainer_args(tmp_path, **kw):
    return transformers.TrainingArguments(str(tmp_path), **{"report_to": "none", "max_steps": STEPS, "use_cpu": True,
                                                            "disable_tqdm": True, "save_strategy": "no", **kw})


def train_with_hf(kind, tmp_path, **kw):
    model = tiny(kind)
    twin = copy.deepcopy(model)
    fed, per_step = [], []
    args = trainer_args(tmp_path, **kw)
    micro = args.gradient_accumulation_steps
    instrument(model, OVERFLOW_AT * micro, record=fed)

    class Record(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **_):
            per_step.append((snapshot(model), trainer.amp.scaler.get_scale(), lr_scheduler.get_last_lr()[0]))

    trainer = abt.hf_trainer(model, "mixed_float16", args, train_dataset=rows(), callbacks=[Record()])
    trainer.train()
    return trainer, twin, fed, per_step, micro


@pytest.mark.parametrize("kind, optim", [("bert", None), ("gpt2", None), ("gpt2", "adamw_torch")])
def test_hf_trainer_equals_the_torch_amp_loop(kind, optim, tmp_path):
    # default arguments (optim None): the fused AdamW, whose skipped steps Accelerate cannot see
    trainer, twin, fed, per_step, _ = train_with_hf(kind, tmp_path, **({"optim": optim} if optim else {}))
    assert len(per_step) == STEPS
    # remove_unused_columns kept the model's inputs (they are in its signature); clipping at 1.0
    assert set(fed[0]) >= {"input_ids", "labels"}
    opt = trainer.optimizer.optimizer
    assert bool(opt.defaults["fused"]) == (optim is None) and trainer.args.max_grad_norm == 1.0
    assert trainer.accelerator.scaler is trainer.amp.scaler
    # the overflow: step skipped (weights unchanged), scale halved, learning rate not advanced
    (w0, s0, lr0), (w1, s1, lr1) = per_step[OVERFLOW_AT - 1], per_step[OVERFLOW_AT]
    assert_same(w1, w0, OVERFLOW_AT)
    assert (s0, s1) == (65536.0, 32768.0) and lr1 == lr0
    assert per_step[-1][2] < lr1  # the schedule moves again after it
    state = trainer.amp.scaler.loss_scale_state()
    assert (state.steps, state.skipped) == (STEPS, 1)

    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(trainer.args)
    hand = hand_loop(twin, fed, 1, max_norm=1.0,
                     make_optimizer=lambda m: cls(m.parameters(), weight_decay=trainer.args.weight_decay, **kwargs),
                     make_scheduler=lambda o: transformers.get_linear_schedule_with_warmup(o, 0, STEPS))
    for step, ((w, s, lr), (hw, hs, hlr)) in enumerate(zip(per_step, hand)):
        assert_same(w, hw, step)
        assert (s, lr) == (hs, hlr), step


def test_hf_trainer_gradient_accumulation_equals_the_torch_amp_loop(tmp_path):
    trainer, twin, fed, per_step, micro = train_with_hf("gpt2", tmp_path, gradient_accumulation_steps=2)
    assert micro == 2 and len(fed) == 2 * STEPS
    # the Trainer's loss is normalised over the accumulated batch (num_items_in_batch): no division
    assert fed[0]["num_items_in_batch"] is not None
    assert per_step[OVERFLOW_AT][1] == per_step[OVERFLOW_AT - 1][1] / 2
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(trainer.args)
    hand = hand_loop(twin, fed, micro, max_norm=1.0,
                     make_optimizer=lambda m: cls(m.parameters(), weight_decay=trainer.args.weight_decay, **kwargs),
                     make_scheduler=lambda o: transformers.get_linear_schedule_with_warmup(o, 0, STEPS))
    for step, ((w, s, lr), (hw, hs, hlr)) in enumerate(zip(per_step, hand)):
        assert_same(w, hw, step)
        assert (s, lr) == (hs, hlr), step


def test_hf_trainer_checkpoint_resumes_the_loss_scale(tmp_path):
    def run(out, resume=None):
        model = tiny("gpt2")
        instrument(model, OVERFLOW_AT if resume is None else -1)  # the resumed run starts after it
        args = trainer_args(out, save_strategy="steps", save_steps=2)
        trainer = abt.hf_trainer(model, "mixed_float16", args, train_dataset=rows())
        trainer.train(resume_from_checkpoint=resume)
        return trainer, snapshot(model)

    whole, weights = run(tmp_path / "whole")
    saved = torch.load(tmp_path / "whole" / "checkpoint-2" / "scaler.pt", weights_only=True)
    assert (saved["scale"], saved["steps"], saved["skipped"]) == (32768.0, 2, 1)  # ampbridge's state dict
    resumed, resumed_weights = run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-2"))
    assert resumed.amp.scaler.loss_scale_state() == whole.amp.scaler.loss_scale_state()
    assert_same(resumed_weights, weights, STEPS)


def test_hf_trainer_follows_a_phase_schedule(tmp_path):
    policy = ampbridge.loads('compute_dtype = "float16"\n[[phase]]\nuntil_step = 2\ncompute_dtype = "float32"\n'
                             '[[phase]]\n', format="toml")
    model = tiny("gpt2")
    seen = []
    model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.dtype) if m.training else None)
    trainer = abt.hf_trainer(model, policy, trainer_args(tmp_path), train_dataset=rows())
    trainer.train()
    assert seen == [torch.float32] * 2 + [torch.float16] * (STEPS - 2)
    assert trainer.amp.phase == 1 and trainer.amp.scaler.config.mode == "dynamic"


def test_hf_trainer_refuses_a_second_amp(tmp_path):
    with pytest.raises(ValueError, match="leave fp16 and bf16 False"):
        abt.hf_trainer(tiny("gpt2"), "mixed_float16", trainer_args(tmp_path, bf16=True), train_dataset=rows())


# --- Lightning -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_lightning_plugin_equals_the_torch_amp_loop(kind, tmp_path):
    lightning = ampbridge._testing.require("lightning")
    net = tiny(kind)
    twin = copy.deepcopy(net)
    fed, per_step = [], []
    instrument(net, OVERFLOW_AT, record=fed)
    plugin = abt.lightning_precision("mixed_float16")

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, index):
            return self.net(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    class Record(lightning.Callback):
        def on_train_batch_end(self, trainer, module, *_):
            per_step.append((snapshot(module.net), plugin.amp.scaler.get_scale(), None))

    trainer = lightning.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, plugins=[plugin], gradient_clip_val=1.0,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[Record()], default_root_dir=str(tmp_path))
    trainer.fit(Module(), torch.utils.data.DataLoader(rows(), batch_size=8))
    assert isinstance(plugin.amp.model, lightning.LightningModule) and plugin.amp.model.net is net
    assert_same(per_step[OVERFLOW_AT][0], per_step[OVERFLOW_AT - 1][0], OVERFLOW_AT)
    assert [s for _, s, _ in per_step] == [65536.0] * OVERFLOW_AT + [32768.0] * (STEPS - OVERFLOW_AT)
    # fused AdamW with clipping: Lightning's own MixedPrecision refuses this combination
    hand = hand_loop(twin, fed, 1, max_norm=1.0, make_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3,
                                                                                         fused=True))
    for step, ((w, s, _), (hw, hs, _)) in enumerate(zip(per_step, hand)):
        assert_same(w, hw, step)
        assert s == hs, step
    state = plugin.state_dict()
    assert state["loss_scale"]["skipped"] == 1 and state["loss_scale"]["scale"] == 32768.0


def test_lightning_checkpoint_resumes_the_loss_scale(tmp_path):
    lightning = ampbridge._testing.require("lightning")

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tiny("gpt2")

        def training_step(self, batch, index):
            return self.net(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(steps, ckpt=None, overflow=OVERFLOW_AT):
        module, plugin = Module(), abt.lightning_precision("mixed_float16")
        instrument(module.net, overflow)
        trainer = lightning.Trainer(max_steps=steps, accelerator="cpu", devices=1, plugins=[plugin], logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                    default_root_dir=str(tmp_path))
        trainer.fit(module, torch.utils.data.DataLoader(rows(), batch_size=8), ckpt_path=ckpt)
        return trainer, plugin

    trainer, plugin = fit(2)
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    assert plugin.state_dict()["loss_scale"]["scale"] == 32768.0
    _, resumed = fit(3, ckpt=str(tmp_path / "two.ckpt"), overflow=-1)
    state = resumed.amp.scaler.loss_scale_state()
    assert (state.scale, state.steps, state.skipped, state.good_steps) == (32768.0, 3, 1, 1)


def test_lightning_plugin_follows_a_phase_schedule(tmp_path):
    lightning = ampbridge._testing.require("lightning")
    policy = ampbridge.loads('compute_dtype = "float16"\n[[phase]]\nuntil_step = 2\ncompute_dtype = "float32"\n'
                             '[[phase]]\n', format="toml")
    net = tiny("gpt2")
    seen = []
    net.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.dtype) if m.training else None)

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, index):
            return self.net(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    plugin = abt.lightning_precision(policy)
    lightning.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, plugins=[plugin], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path)).fit(Module(), torch.utils.data.DataLoader(rows(), batch_size=8))
    assert seen == [torch.float32] * 2 + [torch.float16] * (STEPS - 2)
    assert plugin.amp.phase == 1 and plugin.state_dict()["step"] == STEPS - 1


def test_fabric_plugin_equals_the_torch_amp_loop():
    lightning = ampbridge._testing.require("lightning")
    model = tiny("gpt2")
    twin = copy.deepcopy(model)
    fed = []
    instrument(model, OVERFLOW_AT, record=fed)
    plugin = abt.fabric_precision("mixed_float16", "cpu")
    fabric = lightning.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    module, opt = fabric.setup(model, opt)
    per_step = []
    module.train()
    for _ in range(2):
        for batch in fabric.setup_dataloaders(torch.utils.data.DataLoader(rows(), batch_size=8)):
            loss = module(**batch).loss
            fabric.backward(loss)
            fabric.clip_gradients(module, opt, max_norm=1.0, error_if_nonfinite=False)
            opt.step()
            opt.zero_grad()
            per_step.append((snapshot(model), plugin.amp.scaler.get_scale(), None))
    assert plugin.amp.model is model
    assert [s for _, s, _ in per_step] == [65536.0] * OVERFLOW_AT + [32768.0] * (STEPS - OVERFLOW_AT)
    hand = hand_loop(twin, fed, 1, max_norm=1.0,
                     make_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True))
    for step, ((w, s, _), (hw, hs, _)) in enumerate(zip(per_step, hand)):
        assert_same(w, hw, step)
        assert s == hs, step


def test_fabric_bfloat16_without_fabric_backward_equals_native_fabric():
    """A bfloat16 policy scales nothing, so a plain ``loss.backward()`` is exact. Fabric insists on
    ``fabric.backward`` only for outputs of the wrapped module; a loss computed from the model itself
    (here under ``fabric.autocast()``) steps through the wrapped optimizer without it. Native
    bf16-mixed then just steps; ampbridge's plugin used to fail with torch's "Attempted step but
    _scale is None". Now it trains the same weights."""
    lightning = ampbridge._testing.require("lightning")
    runs = {}
    for name in ("ampbridge", "native"):
        model = tiny("gpt2")
        plugin = abt.fabric_precision("mixed_bfloat16", "cpu") if name == "ampbridge" else None
        fabric = (lightning.Fabric(accelerator="cpu", devices=1, plugins=[plugin]) if plugin is not None
                  else lightning.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed"))
        module, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        module.train()
        before = snapshot(model)
        for batch in fabric.setup_dataloaders(torch.utils.data.DataLoader(rows(), batch_size=8)):
            with fabric.autocast():
                loss = model(**batch).loss  # the model itself, not Fabric's wrapper
            loss.backward()  # not fabric.backward
            fabric.clip_gradients(module, opt, max_norm=1.0, error_if_nonfinite=False)
            opt.step()
            opt.zero_grad()
        runs[name] = snapshot(model)
        assert any(not torch.equal(before[k], runs[name][k]) for k in before), name  # it trained
    assert_same(runs["ampbridge"], runs["native"], "end")


def test_lightning_plugin_offers_the_autocast_context_manager():
    # Lightning's MixedPrecision API, which its plugin tests and user code call directly
    plugin = abt.lightning_precision("mixed_bfloat16", device_type="cpu")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    plugin.convert_module(model)
    with plugin.autocast_context_manager():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert model[0](torch.ones(2, 4)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_importing_the_backend_leaves_the_trainers_out():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    code = ("import sys, ampbridge.torch; print(sorted(m for m in ('transformers', 'accelerate', 'lightning', "
            "'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"


# --- Accelerate's own loop -----------------------------------------------------------------------

def test_accelerate_loop_with_amp_step_equals_the_torch_amp_loop(tmp_path):
    accelerate = ampbridge._testing.require("accelerate")
    model = tiny("gpt2")
    twin = copy.deepcopy(model)
    fed = []
    instrument(model, OVERFLOW_AT, record=fed)
    # what a user writes: Accelerator without mixed precision (the policy does it), amp.step
    accelerator = accelerate.Accelerator(cpu=True)
    amp = abt.apply(model, "mixed_float16", device_type=accelerator.device.type)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=STEPS)
    loader = torch.utils.data.DataLoader(rows(), batch_size=8)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    accelerator.register_for_checkpointing(amp)
    per_step = []
    model.train()
    for _ in range(2):
        for batch in loader:
            loss = model(**batch).loss
            if amp.step(loss, opt, clip_grad_norm=1.0):
                sched.step()
            opt.zero_grad()
            per_step.append((snapshot(model), amp.scaler.get_scale(), sched.get_last_lr()[0]))
    assert [s for _, s, _ in per_step] == [65536.0] * OVERFLOW_AT + [32768.0] * (STEPS - OVERFLOW_AT)
    assert per_step[OVERFLOW_AT][2] == per_step[OVERFLOW_AT - 1][2]
    saved = amp.scaler.loss_scale_state()
    accelerator.save_state(str(tmp_path / "state"))
    amp.load_state_dict({"loss_scale": ampbridge.core.loss_scale.initial_state(amp.scaler.config).to_dict()})
    accelerator.load_state(str(tmp_path / "state"))
    assert amp.scaler.loss_scale_state() == saved and saved.skipped == 1
    hand = hand_loop(twin, fed, 1, max_norm=1.0,
                     make_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
                     make_scheduler=lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.1, total_iters=STEPS))
    for step, ((w, s, lr), (hw, hs, hlr)) in enumerate(zip(per_step, hand)):
        assert_same(w, hw, step)
        assert (s, lr) == (hs, hlr), step
