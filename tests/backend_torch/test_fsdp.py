"""fsdp_policy: the policy in FSDP2 / FSDP1 terms, pins as their own units; a real FSDP2 run."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ampbridge
import ampbridge._testing
from ampbridge import Policy, Rule

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
nn = torch.nn


def test_without_a_model():
    fsdp = abt.fsdp_policy("mixed_bfloat16")
    assert fsdp.mp_policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert fsdp.root_mp_policy.output_dtype == torch.float32
    assert fsdp.mixed_precision == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                  buffer_dtype=torch.float32)
    assert fsdp.pinned == {} and fsdp.pinned_fsdp1 == {}
    fp32 = abt.fsdp_policy("float32")
    assert fp32.mp_policy.param_dtype == torch.float32 and fp32.mixed_precision.param_dtype == torch.float32
    assert any("ShardedGradScaler" in n for n in abt.fsdp_policy("mixed_float16").notes)
    bf16 = abt.fsdp_policy(Policy(compute_dtype="bfloat16", param_dtype="bfloat16", reduce_dtype="float32"))
    assert bf16.mp_policy.reduce_dtype == torch.float32  # reduce_dtype is kept apart from the storage dtype


def test_pins_become_their_own_units(tiny):
    policy = Policy(compute_dtype="float16", keep_float32=("kind:norm",),
                    overrides=(Rule(("fc1",), compute_dtype="bfloat16", output_dtype="float16"),
                               Rule(("head",), output_dtype="float32")))
    fsdp = abt.fsdp_policy(policy, tiny)
    # the same units `ampbridge convert --to fsdp` names (recipes.to_fsdp, given this backend's Plan)
    assert set(fsdp.pinned) == {"ln1", "ln2", "ln3", "fc1", "head", "embed"}
    # the Embedding has no rule, but the Plan computes it in float32 (autocast leaves lookups): FSDP
    # would all-gather it in float16 as part of the root, so it is a unit of its own
    assert fsdp.pinned["embed"].param_dtype == torch.float32
    assert any(n.startswith("embed: the Plan computes it in float32") for n in fsdp.notes)
    assert fsdp.pinned["ln1"] == MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                                      output_dtype=torch.float32)
    assert fsdp.pinned["head"].param_dtype == torch.float16 and fsdp.pinned["head"].output_dtype == torch.float32
    assert fsdp.pinned["fc1"].param_dtype == torch.bfloat16 and fsdp.pinned["fc1"].output_dtype == torch.float16
    assert fsdp.pinned_fsdp1["ln2"].param_dtype == torch.float32
    assert fsdp.pinned_fsdp1["ln2"].buffer_dtype == torch.float32
    # a pinned block is one unit, not one per child
    block = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    assert set(abt.fsdp_policy(Policy(compute_dtype="bfloat16", keep_float32=("1",)), block).pinned) == {"1"}


FSDP_RUN = textwrap.dedent('''
    import copy, sys
    import torch
    import torch.distributed as dist
    import ampbridge
    import ampbridge.torch as abt
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    policy = ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("kind:norm",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                torch.nn.Linear(16, 4))
    plain = copy.deepcopy(model)
    amp_plain = abt.apply(plain, policy)
    amp = abt.apply(model, policy)                     # apply first, then shard
    fsdp = abt.fsdp_policy(policy, model)
    fsdp.shard(model, mesh=init_device_mesh("cpu", (1,)))
    weights = {}

    def record(name):
        def hook(module, args):
            weights.setdefault(name, module.weight.dtype)  # the dtype FSDP all-gathered it in
        return hook

    for name, m in model.named_modules():
        if name and hasattr(m, "weight"):
            m.register_forward_pre_hook(record(name))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, plain)]
    g = torch.Generator().manual_seed(1)
    same = True
    for step in range(3):
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        losses = []
        for m, a, opt in ((model, amp, opts[0]), (plain, amp_plain, opts[1])):
            out = m(x)
            loss = (out - y).square().mean()
            a.step(loss, opt)
            opt.zero_grad()
            losses.append(loss.detach())
        same &= torch.equal(*losses)
    sharded = [p.full_tensor() for p in model.parameters()]
    same &= all(torch.equal(a, b) for a, b in zip(sharded, plain.parameters()))
    print("units", sorted(type(m).__name__ for m in model.modules() if "FSDP" in type(m).__name__))
    print("weights", sorted((k, str(v)) for k, v in weights.items()))
    print("grads", sorted({str(p.dtype) for p in model.parameters()}), "output", out.dtype)
    print("same", same)
    dist.destroy_process_group()
''')


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_single_process_fsdp2_run_matches_the_plain_applied_model(tmp_path):
    script = tmp_path / "fsdp_run.py"
    script.write_text(FSDP_RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script), str(_free_port())], capture_output=True, text=True,
                          env=env, timeout=240)
    if proc.returncode != 0 and "gloo" in proc.stderr.lower() and "address" in proc.stderr.lower():
        pytest.skip(f"no local gloo rendezvous here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["units"] == "['FSDPLayerNorm', 'FSDPSequential']"
    # the pinned LayerNorm's unit all-gathers float32; the rest is all-gathered in bfloat16
    assert lines["weights"] == ("[('0', 'torch.bfloat16'), ('1', 'torch.float32'), ('3', 'torch.bfloat16')]")
    assert lines["grads"] == "['torch.float32'] output torch.float32"
    assert lines["same"] == "True"  # bit-identical to the same policy without FSDP
