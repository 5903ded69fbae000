"""The differential fuzzer for models (issues 36 and 37): random small torch models (depth, residual
connections, ``nn.Sequential``/``nn.ModuleList`` containers, LayerNorm/RMSNorm, an embedding, a
head) under random policies (float16/bfloat16 compute; pins by path, glob, kind and class; float32
``[[override]]``s, some returning their output to the stream): every module computes and delivers
its Plan row's dtypes (the dispatcher's view), and three training steps with an injected overflow
equal the native hand-pinned model bit for bit (losses, parameters, scales, every module's output
dtype). A few examples by default; ``AMPBRIDGE_FUZZ=1`` runs many more."""

from __future__ import annotations

import os
import warnings

import pytest

from ampbridge._testing import require

torch = require("torch")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.torch as abt  # noqa: E402
from ampbridge import LossScaleConfig, Policy, Rule  # noqa: E402

from .native_pins import hand_pin, mismatches, record_outputs, train  # noqa: E402

FUZZ = os.environ.get("AMPBRIDGE_FUZZ") == "1"
SETTINGS = settings(max_examples=300 if FUZZ else 6, deadline=None, derandomize=not FUZZ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
VOCAB, D = 16, 8


class Block(nn.Module):
    """``x + inner(norm(x))`` (or without the residual / the norm)."""

    def __init__(self, norm: str, inner: str, residual: bool):
        super().__init__()
        self.norm = {"layer": nn.LayerNorm(D), "rms": nn.RMSNorm(D), "none": nn.Identity()}[norm]
        self.inner = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D)) if inner == "mlp" \
            else nn.Linear(D, D)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(self.norm(x))
        return x + y if self.residual else y


class Model(nn.Module):
    def __init__(self, blocks: list[tuple[str, str, bool]], sequential: bool, final_norm: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        made = [Block(*b) for b in blocks]
        self.blocks = nn.Sequential(*made) if sequential else nn.ModuleList(made)
        self.final = nn.LayerNorm(D) if final_norm else nn.Identity()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if isinstance(self.blocks, nn.Sequential):
            x = self.blocks(x)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(self.final(x))


BLOCK = st.tuples(st.sampled_from(["layer", "rms", "none"]), st.sampled_from(["mlp", "linear"]), st.booleans())
PINS = st.sampled_from(["kind:norm", "kind:embedding", "head", "blocks.*.norm", "type:LayerNorm", "type:RMSNorm",
                        "blocks.0", "blocks.1.inner", "final", "blocks.0.inner.0"])


@st.composite
def cases(draw):
    blocks = draw(st.lists(BLOCK, min_size=1, max_size=3))
    sequential, final_norm = draw(st.booleans()), draw(st.booleans())
    compute = draw(st.sampled_from(["float16", "bfloat16"]))
    pins = tuple(draw(st.lists(PINS, max_size=4, unique=True)))
    # an output returned to the stream only at the top (head, final): inside a float32 region a float16
    # output feeding a float32 Linear has no native equivalent (torch refuses Half @ Float there)
    overrides = tuple(Rule((path,), compute_dtype="float32",
                           output_dtype=draw(st.sampled_from([None, compute])) if path in ("head", "final") else None)
                      for path in draw(st.lists(PINS.filter(lambda p: not p.startswith(("kind:", "type:"))),
                                                max_size=2, unique=True)))
    policy = Policy(compute_dtype=compute, keep_float32=pins, overrides=overrides,
                    loss_scale=LossScaleConfig(mode="dynamic", initial_scale=1024.0, growth_interval=1))
    return (blocks, sequential, final_norm), policy


def _builder(spec):
    def build():
        torch.manual_seed(0)
        return Model(*spec)
    return build


def _native_paths(plan):
    """The modules a user pins by hand: each row a rule sets to float32 itself, with the output dtype
    it asks for (an override's ``output_dtype``; None: the module emits what it computes)."""
    rules = dict(plan.policy.rules)
    out = {}
    for row in plan.rows:
        rule = rules.get(row.rule)
        if row.path and rule is not None and row.inherited_from is None and row.compute_dtype == "float32":
            out[row.path] = rule.output_dtype
    return out


def _hand_pin_with_outputs(model, wanted):
    hand_pin(model, list(wanted))
    for path, dtype in wanted.items():
        if dtype is not None:
            module = model.get_submodule(path)
            module.register_forward_hook(lambda m, a, out, _d=getattr(torch, dtype): out.to(_d), prepend=True)


def _loss(out, y):
    return F.cross_entropy(out.float().reshape(-1, VOCAB), y.reshape(-1))


def _check(spec, policy, probe):
    build = _builder(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build()
        amp = abt.apply(model, policy)
        ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
        with probe.Probe(model) as seen:
            amp.model(ids)
        probe.check_plan(amp.plan, seen, ignore=() if spec[1] else ("blocks",), model=model)  # ModuleList: no forward
        batches = [((torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(i)),),
                    torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(50 + i)))
                   for i in range(3)]
        ours, amp = train(build, policy, batches, _loss, native=False, inject=(1,))
        native = _native(build, policy, batches, amp.plan)
    assert mismatches(native, ours) == []
    assert ours.scales == [1024.0, 2048.0, 1024.0]  # grew, the injected overflow skipped and backed off


def _native(build, policy, batches, plan):
    """The hand-pinned run (``train(native=True)`` with overrides' output casts added)."""
    import math

    model = build()
    _hand_pin_with_outputs(model, _native_paths(plan))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = policy.resolved_loss_scale
    scaler = torch.amp.GradScaler("cpu", init_scale=cfg.initial_scale, growth_factor=cfg.growth_factor,
                                  backoff_factor=cfg.backoff_factor, growth_interval=cfg.growth_interval)
    seen, handles = record_outputs(model)
    from .native_pins import Trained

    run = Trained()
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=getattr(torch, policy.compute_dtype)):
            out = model(*x)
        loss = _loss(out, y)
        run.scales.append(scaler.get_scale())
        scaler.scale(loss * math.inf if i == 1 else loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        run.losses.append(float(loss))
        if i == 0:
            run.outputs = dict(seen)
    for h in handles:
        h.remove()
    run.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run


@SETTINGS
@given(cases())
def test_random_models_and_policies_equal_native_hand_pinning(probe, case):
    _check(*case, probe)


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_the_issue_model_under_every_kind_of_pin(probe, compute):
    """Explicit examples: the issue's model, pins by kind, class, glob and path, an override."""
    spec = ([("layer", "mlp", True), ("rms", "linear", True)], False, True)
    for pins, overrides in ((("kind:norm", "kind:embedding", "head"), ()),
                            (("type:LayerNorm", "blocks.*.norm"), ()),
                            (("blocks.0",), (Rule(("head",), compute_dtype="float32", output_dtype=compute),))):
        _check(spec, Policy(compute_dtype=compute, keep_float32=pins, overrides=overrides,
                            loss_scale=LossScaleConfig(mode="dynamic", initial_scale=1024.0, growth_interval=1)),
               probe)
