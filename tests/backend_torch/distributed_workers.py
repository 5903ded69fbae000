"""Spawned workers of the distributed tests (not a test module): ``python distributed_workers.py
SCENARIO OUT_DIR PORT`` starts 2 ranks (torch.multiprocessing spawn, gloo on 127.0.0.1) that each
write ``OUT_DIR/rank<r>.pt``; the tests read those files and assert.

Scenarios: ``ddp`` (wrap_ddp: reduce_dtype, overflow on one rank), ``fuzz_ddp`` (the DDP cases
test_fuzz_loss_scale.py drew, ampbridge and the native loop side by side), ``fsdp2`` (fully_shard with the
Plan per group, overflow on one shard, DCP checkpoint and resume), ``deepspeed2`` (ZeRO 2, overflow on
one rank); one process: ``deepspeed``, ``deepspeed_global`` (deepspeed2's global batch, the reference).
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

nn = torch.nn
WORLD = 2
STEPS = 6
LOSS_INF = (1, 0)  # (step, rank): the loss is inf on this rank only, before DDP's reduction
GRAD_INF = (3, 1)  # (step, rank): a gradient made inf on this rank only, after the reduction


def _init(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)


def _record_collectives() -> list[tuple[str, str]]:
    """(collective, dtype) of every reduction FSDP2 and the scaler send (FSDP2 reduce-scatters)."""
    sent: list[tuple[str, str]] = []
    for name in ("all_reduce", "reduce_scatter_single"):
        original = getattr(dist, name)

        def recording(*args, _original=original, _name=name, **kwargs):
            tensor = kwargs["input"] if _name == "reduce_scatter_single" else (args or [kwargs.get("tensor")])[0]
            sent.append((_name, str(tensor.dtype).removeprefix("torch.")))
            return _original(*args, **kwargs)

        setattr(dist, name, recording)
    return sent


def _by_hand() -> str:
    """A pinned float32 LayerNorm between two Linears, sharded by hand without ``apply``: the error."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    fully_shard(model[1], mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    try:
        model(torch.randn(2, 8))
    except RuntimeError as e:
        return str(e)
    return "ran"


def _record_all_reduces() -> list[tuple[str, int]]:
    """Every all_reduce this process sends, as (dtype, numel): what the engine puts on the wire."""
    sent: list[tuple[str, int]] = []
    original = dist.all_reduce

    def recording(tensor: torch.Tensor, *args, **kwargs):
        sent.append((str(tensor.dtype).removeprefix("torch."), tensor.numel()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    return sent


def _batches(global_batch: int = 8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(global_batch, 8, generator=g), torch.randn(global_batch, 4, generator=g))
            for _ in range(STEPS)]


DDP_RUNS = {"float32": ("float32", "float32", "float32"), "bfloat16": ("bfloat16", "float32", "bfloat16"),
            "bfloat16 params": ("bfloat16", "bfloat16", "float32")}  # (compute, param, reduce) dtypes


def _ddp_policy(run: str):
    import ampbridge

    # float32 compute with a dynamic scale: the parity with one process is then the reduction order
    # only; "bfloat16" reduces in bfloat16 under bfloat16 autocast; "bfloat16 params" widens the
    # bfloat16 gradient buckets to a float32 reduction
    compute, param, reduce_dtype = DDP_RUNS[run]
    return ampbridge.Policy(compute_dtype=compute, param_dtype=param, reduce_dtype=reduce_dtype,
                            loss_scale=ampbridge.LossScaleConfig(mode="dynamic", initial_scale=1024.0,
                                                                 growth_interval=2))


def _train(forward, amp, rank: int | None, batches) -> dict:
    """The native loop; rank None is the single process on the global batch (both injections)."""
    opt = torch.optim.SGD(amp.model.parameters(), lr=0.1)
    states, applied = [], []
    for step, (x, y) in enumerate(batches):
        if rank is not None:
            x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        loss = (forward(x).float() - y).square().mean()
        if step == LOSS_INF[0] and rank in (LOSS_INF[1], None):
            loss = loss * math.inf
        amp.scaler.scale(loss).backward()
        if step == GRAD_INF[0] and rank in (GRAD_INF[1], None):
            with torch.no_grad():
                next(amp.model.parameters()).grad[0, 0] = math.inf
        amp.scaler.step(opt)
        amp.scaler.update()
        states.append(amp.scaler.loss_scale_state().to_dict())
        applied.append(bool(amp.scaler.last_step_result))
        opt.zero_grad()
    return {"states": states, "applied": applied,
            "params": [p.detach().clone() for p in amp.model.parameters()]}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def ddp(rank: int, port: int, out: str) -> None:
    import ampbridge.torch as abt

    _init(rank, port)
    sent = _record_all_reduces()
    result = {}
    batches = _batches()
    for name in DDP_RUNS:
        policy = _ddp_policy(name)
        amp = abt.apply(_model(), policy)
        model = abt.wrap_ddp(amp)
        del sent[:]
        run = _train(model, amp, rank, batches)
        run["sent"] = list(sent)
        if rank == 0:  # the same global batch in one process, no DDP
            single = abt.apply(_model(), policy)
            run["single"] = _train(single.model, single, None, batches)
        result[name] = run
    result["no_sync"] = _ddp_no_sync(rank, batches)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()  # rank 0 trains the one-process reference after the others: leave together (a rank
    dist.destroy_process_group()  # tearing gloo down while its peer still runs aborted once in CI)


def _ddp_no_sync(rank: int, batches) -> dict:
    """Two micro-batches per step, the first under ``no_sync()``; rank 0's first micro-batch of step 0
    overflows: the synced second backward reduces the accumulated inf, so every rank skips."""
    import ampbridge.torch as abt

    amp = abt.apply(_model(), _ddp_policy("float32"))
    model = abt.wrap_ddp(amp)
    opt = torch.optim.SGD(amp.model.parameters(), lr=0.1)
    applied = []
    for step in range(2):
        x, y = batches[step]
        first, second = x.chunk(WORLD)[rank].chunk(2), y.chunk(WORLD)[rank].chunk(2)
        with model.no_sync():
            loss = (model(first[0]) - second[0]).square().mean()
            amp.scaler.scale(loss * math.inf if (step, rank) == (0, 0) else loss).backward()
        amp.step((model(first[1]) - second[1]).square().mean(), opt)
        applied.append(bool(amp.scaler.last_step_result))
        opt.zero_grad()
    return {"applied": applied, "params": [p.detach().clone() for p in amp.model.parameters()]}


class Transformer(nn.Module):
    """Embedding, 2 pre-norm encoder layers (LayerNorm, attention, MLP), final LayerNorm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                                                norm_first=True) for _ in range(2)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


FSDP_STEPS = 6
FSDP_SAVE_AT = 3  # the DCP checkpoint is written after this many steps
FSDP_GRAD_INF = (2, 1)  # (step, rank): one element of this rank's gradient shard made inf


def fsdp_policy(reduce_dtype: str = "float32"):
    import ampbridge

    return ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",), reduce_dtype=reduce_dtype,
                            loss_scale=ampbridge.LossScaleConfig(mode="dynamic", initial_scale=1024.0,
                                                                 growth_interval=2))


def _fsdp_batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 16, (4, 5), generator=g), torch.randint(0, 16, (4, 5), generator=g))
            for _ in range(FSDP_STEPS)]


def _fsdp_setup(reduce_dtype: str = "float32"):
    import ampbridge.torch as abt
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Transformer()
    amp = abt.apply(model, fsdp_policy(reduce_dtype))
    abt.wrap_fsdp(amp, units=("blocks.0", "blocks.1"), mesh=init_device_mesh("cpu", (WORLD,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, amp, opt


def _fsdp_steps(model, amp, opt, rank, steps, batches) -> tuple[list, list]:
    """rank None: one process, no FSDP, the global batch (the same step made non-finite)."""
    states, applied = [], []
    for step in steps:
        ids, target = batches[step]
        if rank is not None:
            ids, target = ids.chunk(WORLD)[rank], target.chunk(WORLD)[rank]
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), target.reshape(-1))
        amp.scaler.scale(loss).backward()
        if step == FSDP_GRAD_INF[0] and rank in (FSDP_GRAD_INF[1], None):
            with torch.no_grad():  # after the reduce-scatter: on this rank's shard only
                grad = model.head.weight.grad
                (grad.to_local() if rank is not None else grad)[0, 0] = math.inf
        amp.scaler.step(opt)
        amp.scaler.update()
        opt.zero_grad()
        states.append(amp.scaler.loss_scale_state().to_dict())
        applied.append(bool(amp.scaler.last_step_result))
    return states, applied


def _full(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _checkpoint_state(model, opt, amp) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, opt_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": opt_state, "amp": amp.state_dict()}


def fsdp2(rank: int, port: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    import ampbridge.torch as abt

    _init(rank, port)
    sent = _record_collectives()
    model, amp, opt = _fsdp_setup()
    initial = _full(model)
    seen: dict[str, tuple[str, str]] = {}  # path -> (parameter dtype, output dtype) in the first forward

    def record(path):
        def hook(module, args, output):
            weight = next(module.parameters(recurse=False), None)
            seen.setdefault(path, (str(getattr(weight, "dtype", None)).removeprefix("torch."),
                                   str(output.dtype).removeprefix("torch.")))
        return hook

    for path, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding)):
            module.register_forward_hook(record(path))
    batches = _fsdp_batches()
    states, applied = _fsdp_steps(model, amp, opt, rank, range(FSDP_SAVE_AT), batches)
    dcp.save(_checkpoint_state(model, opt, amp), checkpoint_id=os.path.join(out, "dcp"))
    more = _fsdp_steps(model, amp, opt, rank, range(FSDP_SAVE_AT, FSDP_STEPS), batches)
    result = {"seen": seen, "plan": {r.path: r.compute_dtype for r in amp.plan.rows},
              "states": states + more[0], "applied": applied + more[1], "params": _full(model),
              "units": sorted(p for p, m in model.named_modules() if "FSDP" in type(m).__name__),
              "sent": {"float32": sorted(set(sent))}, "by_hand": _by_hand(),
              "initial": initial}
    model, amp, opt = _fsdp_setup("bfloat16")
    del sent[:]
    _fsdp_steps(model, amp, opt, rank, range(1), batches)
    result["sent"]["bfloat16"] = sorted(set(sent))
    if rank == 0:
        torch.manual_seed(0)
        single = abt.apply(Transformer(), fsdp_policy())
        opt = torch.optim.SGD(single.model.parameters(), lr=0.1, momentum=0.9)
        result["single"] = _fsdp_steps(single.model, single, opt, None, range(FSDP_STEPS), batches)
        result["single_params"] = {n: p.detach().clone() for n, p in single.model.named_parameters()}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def fsdp2_resume(rank: int, port: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _init(rank, port)
    model, amp, opt = _fsdp_setup()
    state = _checkpoint_state(model, opt, amp)
    dcp.load(state, checkpoint_id=os.path.join(out, "dcp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    amp.load_state_dict(state["amp"])
    states, applied = _fsdp_steps(model, amp, opt, rank, range(FSDP_SAVE_AT, FSDP_STEPS), _fsdp_batches())
    torch.save({"states": states, "applied": applied, "params": _full(model)},
               os.path.join(out, f"resumed{rank}.pt"))


DS_OVERFLOWS = [False, False, False, True, False, False, False, True, True, False, False, False, False]


def deepspeed_policy(reduce_dtype: str = "float32"):
    import ampbridge

    return ampbridge.Policy(compute_dtype="float16", output_dtype="float16", reduce_dtype=reduce_dtype,
                            loss_scale=ampbridge.LossScaleConfig(mode="dynamic", initial_scale=256.0, growth_interval=2,
                                                                 hysteresis=2, min_scale=1.0, on_min_scale="error"))


def deepspeed(port: int, out: str) -> None:
    """One process, DeepSpeed's CPU accelerator, ZeRO 2, the config written from the policy."""
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
    import deepspeed as ds

    import ampbridge.torch as abt
    from ampbridge.errors import UnsupportedOptionError

    torch.set_num_threads(1)
    ds.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
    try:
        abt.deepspeed_initialize(model, deepspeed_policy(), config, model_parameters=model.parameters())
        refused = ""
    except UnsupportedOptionError as e:
        refused = str(e)
    try:
        abt.deepspeed_initialize(model, deepspeed_policy(), {**config, "bf16": {"enabled": True}})
        clash = ""
    except ValueError as e:
        clash = str(e)
    engine, opt, _, _ = abt.deepspeed_initialize(model, deepspeed_policy(), config, model_parameters=model.parameters(),
                                                 accept=["loss_scale.first_growth_interval"])
    states = []
    for overflow in DS_OVERFLOWS:
        x = torch.randn(4, 8, dtype=torch.float16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss * math.inf if overflow else loss)
        engine.step()
        states.append((float(opt.loss_scaler.cur_scale), int(opt.loss_scaler.cur_hysteresis)))
    result = {"refused": refused, "clash": clash, "states": states, "skipped": engine.skipped_steps, "version": ds.__version__,
              "dtype": str(next(engine.module.parameters()).dtype), "fp16": dict(engine.config["fp16"])
              if isinstance(engine.config, dict) else None, "optimizer": type(opt).__name__}
    result["autocast"] = _deepspeed_autocast_with_pins(config)
    torch.save(result, os.path.join(out, "deepspeed.pt"))


def _deepspeed_autocast_with_pins(config: dict) -> dict:
    """DeepSpeed's torch_autocast over ampbridge's regions: the pinned LayerNorm computes in float32."""
    import ampbridge
    import ampbridge.torch as abt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))
    policy = ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",),
                              loss_scale=ampbridge.LossScaleConfig(skip_nonfinite=False))
    from ampbridge.errors import UnsupportedOptionError

    try:  # the same policy on the bare model: DeepSpeed's torch.autocast alone has no module pins
        abt.deepspeed_initialize(model, policy, config, via="torch_autocast")
        bare = ""
    except UnsupportedOptionError as e:
        bare = str(e)
    amp = abt.apply(model, policy)
    engine, _, _, _ = abt.deepspeed_initialize(amp, None, config, via="torch_autocast",
                                               model_parameters=model.parameters())
    seen: dict[str, str] = {}

    def record(name):
        def hook(module, args, output):
            seen.setdefault(name, str(output.dtype).removeprefix("torch."))
        return hook

    for name, module in model.named_children():
        module.register_forward_hook(record(name))
    for _ in range(2):
        loss = engine(torch.randn(4, 8)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    return {"bare": bare, "seen": seen, "plan": {r.path: r.compute_dtype for r in amp.plan.rows if r.path},
            "section": dict(engine.config["torch_autocast"]),
            "params": sorted({str(p.dtype) for p in model.parameters()})}


DS_OVERFLOW_RANK = 1  # the rank whose loss is inf at the DS_OVERFLOWS steps; the other rank stays finite


def _deepspeed_engine(micro_batch: int, reduce_dtype: str = "float32"):
    """ZeRO 2 with fp16 from deepspeed_policy(reduce_dtype) on the process group already set up."""
    import ampbridge.torch as abt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
    engine, opt, _, _ = abt.deepspeed_initialize(model, deepspeed_policy(reduce_dtype), config,
                                                 model_parameters=model.parameters(),
                                                 accept=["loss_scale.first_growth_interval"])
    return engine, opt


_DS_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                   "all_gather", "all_gather_into_tensor", "broadcast")


def _record_deepspeed_collectives() -> dict:
    """Wrap torch.distributed's collectives (deepspeed.comm looks them up at each call) to log what is sent.

    While ``on["steps"]`` is true each call appends (name, op, dtypes, elements) to ``on["sent"]``.
    """
    # deepspeed.comm's TorchBackend calls torch.distributed.all_reduce etc. by attribute at each call
    # (checked: deepspeed 0.19.8), so wrapping the public functions sees what the engine sends
    on: dict = {"steps": False, "sent": []}
    sent = on["sent"]

    def wrap(name, original):
        def collective(*args, **kwargs):
            if on["steps"]:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                tensors += [t for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))
                            for t in a if isinstance(t, torch.Tensor)]
                op = kwargs.get("op", next((a for a in args if isinstance(a, dist.ReduceOp.RedOpType)), None))
                sent.append((name, str(op), sorted({str(t.dtype).removeprefix("torch.") for t in tensors}),
                             sum(t.numel() for t in tensors)))
            return original(*args, **kwargs)
        return collective

    for name in _DS_COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    return on


def _deepspeed_train(rank: int | None) -> dict:
    """The global batch of 8 per step; rank None is one process on all of it (the reference).

    With ranks, the collectives DeepSpeed calls through torch.distributed during the steps are recorded
    under "sent" (all_gather_into_tensor, bound once at init_distributed, is not seen: it carries the
    updated parameters, not gradients).
    """
    recording = _record_deepspeed_collectives() if rank is not None else {"sent": []}
    engine, opt = _deepspeed_engine(8 if rank is None else 8 // WORLD)
    recording["steps"] = True
    g = torch.Generator().manual_seed(2)
    states = []
    for overflow in DS_OVERFLOWS:
        x = torch.randn(8, 8, generator=g).half()
        if rank is not None:
            x = x.chunk(WORLD)[rank]
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss * math.inf if overflow and rank in (DS_OVERFLOW_RANK, None) else loss)
        engine.step()
        states.append((float(opt.loss_scaler.cur_scale), int(opt.loss_scaler.cur_hysteresis)))
    recording["steps"] = False
    result = {"states": states, "skipped": engine.skipped_steps, "sent": list(recording["sent"]),
              "config": dict(engine.config) if isinstance(engine.config, dict) else None,
              "params": [p.detach().float().clone() for p in engine.module.parameters()]}
    if rank is not None:
        result["bfloat16"] = _deepspeed_sends(rank, "bfloat16", recording)
    return result


DS_SENDS_STEPS = 2  # finite steps of the second engine (reduce_dtype bfloat16) in the same ranks


def _deepspeed_sends(rank: int, reduce_dtype: str, recording: dict) -> dict:
    """A second engine in the same ranks (no second process start): the policy with ``reduce_dtype``,
    DS_SENDS_STEPS finite steps, what it sends recorded as in ``_deepspeed_train``."""
    engine, _ = _deepspeed_engine(8 // WORLD, reduce_dtype)
    initial = [p.detach().float().clone() for p in engine.module.parameters()]
    del recording["sent"][:]
    recording["steps"] = True
    g = torch.Generator().manual_seed(3)
    for _ in range(DS_SENDS_STEPS):
        x = torch.randn(8, 8, generator=g).half().chunk(WORLD)[rank]
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    recording["steps"] = False
    return {"sent": list(recording["sent"]), "skipped": engine.skipped_steps, "initial": initial,
            "config": dict(engine.config) if isinstance(engine.config, dict) else None,
            "params": [p.detach().float().clone() for p in engine.module.parameters()]}


def _ds_env(rank: int, world: int, port: int) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    import deepspeed as ds

    torch.set_num_threads(1)
    ds.init_distributed(dist_backend="gloo")


def deepspeed2(rank: int, port: int, out: str) -> None:
    """2 ranks of DeepSpeed's CPU engine (gloo), the overflow on DS_OVERFLOW_RANK only."""
    _ds_env(rank, WORLD, port)
    torch.save(_deepspeed_train(rank), os.path.join(out, f"ds{rank}.pt"))


def deepspeed_global(port: int, out: str) -> None:
    """The same run in one process on the whole global batch: the reference for deepspeed2."""
    _ds_env(0, 1, port)
    torch.save(_deepspeed_train(None), os.path.join(out, "ds_global.pt"))


class _Dot(nn.Module):
    """Parameters whose loss is ``sum(p * g)``: the gradients are the g given to the forward."""

    def __init__(self, values: list) -> None:
        super().__init__()
        for i, value in enumerate(values):
            self.register_parameter(f"p{i}", nn.Parameter(torch.tensor(value, dtype=torch.float32)))

    def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.parameters(), grads))


def fuzz_ddp(rank: int, port: int, out: str) -> None:
    """The DDP cases test_fuzz_loss_scale.py drew (``OUT/cases.json``), each run twice on this rank:
    ampbridge (apply, wrap_ddp, amp.step) and the native loop (DDP, torch.amp.GradScaler). Saves per
    case and step: applied, scale, growth tracker, and the parameters' bit patterns, for both."""
    import json

    import ampbridge
    import ampbridge.torch as abt
    from torch.nn.parallel import DistributedDataParallel

    _init(rank, port)
    with open(os.path.join(out, "cases.json")) as f:
        cases = json.load(f)
    results = []
    for case in cases:
        ls = case["settings"]
        policy = ampbridge.Policy(compute_dtype="float16", loss_scale=ampbridge.LossScaleConfig(mode="dynamic", **ls))
        runs = {}
        for side in ("ours", "native"):
            model = _Dot(case["values"])
            params = list(model.parameters())
            opt = torch.optim.SGD(params, lr=0.25, momentum=0.5, **case["impl"])
            if side == "ours":
                amp = abt.apply(model, policy, device_type="cpu")
                ddp = abt.wrap_ddp(amp)
            else:
                ddp = DistributedDataParallel(model)
                scaler = torch.amp.GradScaler("cpu", init_scale=ls["initial_scale"], growth_factor=ls["growth_factor"],
                                              backoff_factor=ls["backoff_factor"], growth_interval=ls["growth_interval"])
            rows = []
            for step in case["steps"]:
                grads = [torch.tensor(g, dtype=torch.float32) for g in step["grads"][rank]]
                loss = ddp(grads)
                if side == "ours":
                    applied = bool(amp.step(loss, opt))
                    scale, tracker = amp.scaler._scale, amp.scaler._growth_tracker
                else:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    applied = not sum(f.item() for f in scaler._found_inf_per_device(opt).values())
                    scaler.update()
                    scale, tracker = scaler._scale, scaler._growth_tracker
                opt.zero_grad()
                rows.append({"applied": applied, "scale": scale.view(torch.int32).item(), "tracker": tracker.item(),
                             "params": [p.detach().reshape(-1).view(torch.int32).tolist() for p in params]})
            runs[side] = rows
        results.append(runs)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def _main(rank: int, scenario: str, port: int, out: str) -> None:
    try:
        globals()[scenario](rank, port, out)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    scenario, out, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # for the spawned ranks
    if scenario in ("deepspeed", "deepspeed_global"):  # one process
        sys.exit(globals()[scenario](port, out))
    mp.spawn(_main, args=(scenario, port, out), nprocs=WORLD, join=True)
