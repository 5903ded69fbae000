"""Distributed torch with the policy: DDP (wrap_ddp) and FSDP2 (wrap_fsdp), 2 ranks with gloo on
127.0.0.1.

The ranks run in tests/backend_torch/distributed_workers.py (spawned), write what they saw, and
the assertions are here.
"""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import ampbridge
import ampbridge._testing

torch = ampbridge._testing.require("torch")

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).with_name("distributed_workers.py")
_spec = importlib.util.spec_from_file_location("distributed_workers", WORKERS)
workers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workers)  # its constants and policies: what the ranks ran


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(scenario: str, out: Path, timeout: int = 240) -> None:
    """``distributed_workers.py SCENARIO OUT PORT`` in its own session: on a timeout the whole group
    (the launcher and its spawned ranks) is killed, so no rank is left waiting in a collective."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_BUILD_OPS": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(WORKERS), scenario, str(out), str(_free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{scenario} ran past {timeout} s: {output[-3000:]}")
    assert proc.returncode == 0, output[-4000:]


def spawn(scenario: str, out: Path, prefix: str = "rank") -> list[dict]:
    """Run a 2-rank scenario; the per-rank results it saved (``OUT/<prefix><rank>.pt``)."""
    run_workers(scenario, out)
    return [torch.load(out / f"{prefix}{r}.pt") for r in range(workers.WORLD)]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    return spawn("ddp", tmp_path_factory.mktemp("ddp"))


def _expected_states(policy):
    found = [step in (workers.LOSS_INF[0], workers.GRAD_INF[0]) for step in range(workers.STEPS)]
    return [s.to_dict() for s in ampbridge.trajectory(policy.loss_scale, found)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(workers.DDP_RUNS))
def test_ddp_skips_together_and_matches_one_process(ddp_runs, name):
    ranks = [r[name] for r in ddp_runs]
    expected = _expected_states(workers._ddp_policy(name))
    skipped = [workers.LOSS_INF[0], workers.GRAD_INF[0]]
    for run in ranks:
        # the loss overflow on rank 0 reaches rank 1 through DDP's reduction; the gradient made
        # non-finite on rank 1 after the reduction reaches rank 0 only through the found_inf all-reduce
        assert [i for i, applied in enumerate(run["applied"]) if not applied] == skipped
        assert run["states"] == expected  # the core reference, every field, on every rank
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))
    single = ranks[0]["single"]
    assert single["states"] == expected
    # same global batch in one process: float32 differs by the reduction order only; a bfloat16
    # all-reduce rounds every gradient to bfloat16 once more (measured 3e-8 and 2e-4); bfloat16
    # parameters round every update (measured 1e-3: one bfloat16 ulp)
    atol = {"float32": 1e-6, "bfloat16": 2e-3, "bfloat16 params": 1e-2}[name]
    for a, b in zip(ranks[0]["params"], single["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(workers.DDP_RUNS))
def test_ddp_sends_gradients_in_reduce_dtype(ddp_runs, name):
    _, param_dtype, reduce_dtype = workers.DDP_RUNS[name]
    for rank in ddp_runs:
        sent = rank[name]["sent"]
        assert {str(p.dtype) for p in rank[name]["params"]} == {f"torch.{param_dtype}"}  # the bucket's dtype
        numel = sum(p.numel() for p in rank[name]["params"])
        buckets = [dtype for dtype, n in sent if n == numel]  # one bucket holds this small model
        assert buckets == [reduce_dtype] * workers.STEPS
        # and one found_inf flag per step, float32
        assert [s for s in sent if s[1] == 1] == [("float32", 1)] * workers.STEPS


@pytest.mark.slow
def test_ddp_no_sync_accumulation_skips_together(ddp_runs):
    # an overflow in rank 0's first micro-batch (under no_sync) reaches rank 1 with the synced backward
    runs = [r["no_sync"] for r in ddp_runs]
    assert [r["applied"] for r in runs] == [[False, True]] * workers.WORLD
    assert all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[1]["params"]))


def test_the_agreement_stays_with_its_process():
    import pickle

    import ampbridge.torch as abt

    scaler = abt.GradScaler(ampbridge.LossScaleConfig(mode="dynamic"))
    scaler.agree_across(None)
    assert scaler._agree_group == (None,)
    # a process group cannot travel: the copy agrees with no one until agree_across is called again
    assert pickle.loads(pickle.dumps(scaler))._agree_group is None


def test_the_hook_follows_the_policy_in_force():
    # the comm hook reads reduce_dtype from the amp at every step (a [[phase]] may change it)
    import ampbridge.torch as abt
    from ampbridge.backends.torch.distributed import _Reduce

    amp = abt.apply(torch.nn.Linear(2, 2), ampbridge.Policy(param_dtype="bfloat16", reduce_dtype="float32"))
    assert _Reduce(amp, None).dtype() == torch.float32
    amp = abt.apply(torch.nn.Linear(2, 2), ampbridge.Policy(compute_dtype="bfloat16"))
    assert _Reduce(amp, None).dtype() == torch.float32
    amp = abt.apply(torch.nn.Linear(2, 2), ampbridge.Policy(compute_dtype="bfloat16", param_dtype="bfloat16"))
    assert _Reduce(amp, None).dtype() == torch.bfloat16  # reduce_dtype defaults to param_dtype


# --- FSDP2 ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    ranks = spawn("fsdp2", out)
    resumed = spawn("fsdp2_resume", out, prefix="resumed")  # fresh processes, from the DCP checkpoint
    return ranks, resumed


@pytest.mark.slow
def test_fsdp2_realises_the_plan_per_group(fsdp_runs):
    ranks, _ = fsdp_runs
    for rank in ranks:
        # pinned norms and the Embedding (float32 in the Plan: autocast leaves lookups) are units of
        # their own, all-gathered in float32; each block is a unit, the rest is the root's
        assert rank["units"] == ["", "blocks.0", "blocks.0.norm1", "blocks.0.norm2", "blocks.1", "blocks.1.norm1",
                                 "blocks.1.norm2", "embed", "norm"]
        assert len(rank["seen"]) == 11
        for path, (param_dtype, output_dtype) in rank["seen"].items():
            # the dtype FSDP all-gathered the weight in and the output's dtype are the Plan's compute dtype
            assert (param_dtype, output_dtype) == (rank["plan"][path],) * 2, path
        assert {rank["plan"][p] for p in rank["seen"] if "norm" in p} == {"float32"}
        assert rank["plan"]["head"] == "bfloat16"
        # the same wiring by hand, without apply's regions, fails at the float32 -> bfloat16 boundary
        assert "mat1 and mat2 must have the same dtype" in rank["by_hand"]


@pytest.mark.slow
def test_fsdp2_reduces_in_reduce_dtype(fsdp_runs):
    for rank in fsdp_runs[0]:
        for reduce_dtype in ("float32", "bfloat16"):
            # FSDP2's gradient reduce-scatter in reduce_dtype; the scaler's found_inf all-reduce in float32
            assert rank["sent"][reduce_dtype] == [("all_reduce", "float32"), ("reduce_scatter_single", reduce_dtype)]


@pytest.mark.slow
def test_fsdp2_overflow_on_one_shard_skips_every_rank(fsdp_runs):
    ranks, _ = fsdp_runs
    found = [step == workers.FSDP_GRAD_INF[0] for step in range(workers.FSDP_STEPS)]
    expected = [s.to_dict() for s in ampbridge.trajectory(workers.fsdp_policy().loss_scale, found)]
    single_states, single_applied = ranks[0]["single"]
    assert single_states == expected
    for rank in ranks:
        # only rank 1's shard of head.weight's gradient was made inf; rank 0 skips through the all-reduce
        assert rank["applied"] == single_applied == [not f for f in found]
        assert rank["states"] == expected
    names = list(ranks[0]["params"])
    assert all(torch.equal(ranks[0]["params"][n], ranks[1]["params"][n]) for n in names)
    # one process without FSDP on the same global batch: FSDP2 casts each unit's inputs to bfloat16
    # at its boundary (a bfloat16 residual stream where autocast alone keeps float32) and rounds each
    # rank's gradients to bfloat16 before the float32 reduce-scatter (measured 3% of the update)
    diff = torch.cat([(ranks[0]["params"][n] - ranks[0]["single_params"][n]).flatten() for n in names])
    update = torch.cat([(ranks[0]["single_params"][n] - ranks[0]["initial"][n]).flatten() for n in names])
    assert diff.norm() < 0.1 * update.norm()


@pytest.mark.slow
def test_fsdp2_dcp_checkpoint_resumes_exactly(fsdp_runs):
    ranks, resumed = fsdp_runs
    for rank, again in zip(ranks, resumed):
        # the loss-scale state travels in the checkpoint (amp.state_dict()): same trajectory, same params
        assert again["states"] == rank["states"][workers.FSDP_SAVE_AT:]
        assert again["applied"] == rank["applied"][workers.FSDP_SAVE_AT:]
        assert all(torch.equal(again["params"][n], rank["params"][n]) for n in rank["params"])


# --- DeepSpeed -----------------------------------------------------------------------------------

def _need_deepspeed_fp16():
    from ampbridge._testing import deepspeed_fp16

    if not deepspeed_fp16():
        pytest.skip("DeepSpeed refuses a float16 engine on this CPU (its CPU accelerator needs "
                    "torch.ops.mkldnn._is_mkldnn_fp16_supported(), false here)")


def test_deepspeed_engine_the_accelerator_refuses_is_refused_by_name(monkeypatch):
    """DeepSpeed's own refusal names neither the policy nor the setting; ampbridge's comes first,
    before deepspeed.initialize (no process group needed), listing the compute dtypes accepted."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    import ampbridge.torch as abt
    from ampbridge.errors import UnsupportedOptionError

    accelerator = get_accelerator()
    monkeypatch.setattr(accelerator, "is_fp16_supported", lambda: False)  # as on the AMD VM
    monkeypatch.setattr(accelerator, "is_bf16_supported", lambda: True)
    accept = ["loss_scale.first_growth_interval", "loss_scale.min_scale", "output_dtype"]
    model = torch.nn.Linear(4, 4)
    with pytest.raises(UnsupportedOptionError, match=r"^preset:mixed_float16: compute_dtype = 'float16' needs "
                       r"DeepSpeed's fp16 engine, which its '\w+' accelerator refuses on this machine "
                       r"\(is_fp16_supported\(\) is False.*accepted here: compute_dtype 'float32', 'bfloat16'$"):
        abt.deepspeed_initialize(model, "mixed_float16", {"train_micro_batch_size_per_gpu": 1}, accept=accept)
    monkeypatch.setattr(accelerator, "is_bf16_supported", lambda: False)
    with pytest.raises(UnsupportedOptionError, match="compute_dtype = 'bfloat16' needs DeepSpeed's bf16 engine.*"
                       "accepted here: compute_dtype 'float32'$"):
        abt.deepspeed_initialize(model, "mixed_bfloat16", {"train_micro_batch_size_per_gpu": 1}, accept=accept)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing was cast


@pytest.mark.slow
def test_deepspeed_engine_from_the_policy_follows_the_promised_trajectory(tmp_path):
    pytest.importorskip("deepspeed")
    _need_deepspeed_fp16()
    from ampbridge._testing import DeepSpeedDynamicLossScaler
    from ampbridge.recipes import deepspeed_releases

    run_workers("deepspeed", tmp_path)  # one process
    run = torch.load(tmp_path / "deepspeed.pt")
    # refused by name until accepted: the installed release grows one step later than the policy says
    assert run["refused"].startswith(f"DeepSpeed {run['version']} (ZeRO stage 2) cannot realise "
                                     "loss_scale.first_growth_interval = 2")
    assert run["clash"].startswith("config holds precision section(s) ['bf16']")
    assert run["optimizer"] == "DeepSpeedZeroOptimizer" and run["dtype"] == "torch.float16"
    assert run["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2,
                           "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}
    # what recipes promises for this release: ampbridge's algorithm with DeepSpeed's growth test
    late = deepspeed_releases.grows_late(run["version"])
    oracle = DeepSpeedDynamicLossScaler(256.0, 2, 1.0, 2, False,
                                        growth_test="stable_interval" if late else "modulo")
    promised = []
    for overflow in workers.DS_OVERFLOWS:
        oracle.update_scale(overflow)
        promised.append((oracle.cur_scale, oracle.cur_hysteresis))
    assert run["states"] == promised
    assert run["skipped"] == sum(workers.DS_OVERFLOWS)
    reference = [(s.scale, s.hysteresis_left) for s in
                 ampbridge.trajectory(workers.deepspeed_policy().resolved_loss_scale, workers.DS_OVERFLOWS)]
    # and the accepted loss is real: the engine parts from ampbridge's reference where it said
    assert (run["states"] != reference) is late
    # DeepSpeed's torch_autocast over ampbridge's regions: the pins DeepSpeed alone refuses are realised
    autocast = run["autocast"]
    assert "keep_float32 = ['kind:norm']: torch.autocast has per-op lists, not per-module pins" in autocast["bare"]
    assert autocast["section"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    assert autocast["seen"] == autocast["plan"] == {"0": "bfloat16", "1": "float32", "2": "bfloat16"}
    assert autocast["params"] == ["torch.float32"]


@pytest.mark.slow
def test_deepspeed_two_ranks_skip_together_and_match_one_process(tmp_path):
    pytest.importorskip("deepspeed")
    _need_deepspeed_fp16()
    from ampbridge._testing import DeepSpeedDynamicLossScaler
    from ampbridge.recipes import deepspeed_releases

    ranks = spawn("deepspeed2", tmp_path, prefix="ds")  # the inf loss on one rank only
    run_workers("deepspeed_global", tmp_path)  # one process, the same global batch
    single = torch.load(tmp_path / "ds_global.pt")
    import deepspeed

    oracle = DeepSpeedDynamicLossScaler(256.0, 2, 1.0, 2, False, growth_test="stable_interval"
                                        if deepspeed_releases.grows_late(deepspeed.__version__) else "modulo")
    promised = []
    for overflow in workers.DS_OVERFLOWS:
        oracle.update_scale(overflow)
        promised.append((oracle.cur_scale, oracle.cur_hysteresis))
    for run in ranks:  # ZeRO all-reduces the overflow flag: the finite rank skips with the other
        assert run["states"] == promised == single["states"]
        assert run["skipped"] == sum(workers.DS_OVERFLOWS) == single["skipped"]
    torch.manual_seed(0)  # the init both runs started from (the workers' model)
    init = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).half()
    for a, b, c, p0 in zip(ranks[0]["params"], ranks[1]["params"], single["params"], init.parameters()):
        assert torch.equal(a, b)  # the ranks hold the same (all-gathered) parameters
        assert not torch.equal(a, p0.float())  # the 10 applied steps moved them
        # fp16 params from fp32 masters, 2 ranks averaged vs one batch of 8: the reduction order only;
        # measured (deepspeed 0.19.8, CPU): at most 1.2e-4, one float16 ulp of a weight in [0.125, 0.25)
        torch.testing.assert_close(a, c, rtol=0, atol=2.5e-4)
    # what ZeRO 2 actually sends: reduce_dtype (float32 by default) is written as communication_data_type,
    # fp16 mode's own default (float16 gradients) only when reduce_dtype is float16
    config = ranks[0]["config"]
    reduce = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[config.get("communication_data_type", "fp16")]
    assert reduce == workers.deepspeed_policy().reduce_dtype == "float32"
    grads = sum(p.numel() for p in init.parameters())
    for run in ranks:  # one gradient all-reduce a step (overflowed steps too), then the overflow flag's MAX
        assert [s for s in run["sent"] if s[3] == grads] == [("all_reduce", "RedOpType.SUM", [reduce], grads)] * len(
            workers.DS_OVERFLOWS)
        assert sum(s[:2] == ("all_reduce", "RedOpType.MAX") for s in run["sent"]) == len(workers.DS_OVERFLOWS)
    # a second engine in the same ranks, the policy with reduce_dtype = "bfloat16" (fp16 compute):
    # communication_data_type = "bf16" is written, and ZeRO 2 casts each fp16 gradient bucket to
    # bfloat16 before the all-reduce (gloo sums bfloat16 on CPU)
    sends = [run["bfloat16"] for run in ranks]
    assert sends[0]["config"]["communication_data_type"] == "bf16"
    for run in sends:
        assert [s for s in run["sent"] if s[3] == grads] == [("all_reduce", "RedOpType.SUM", ["bfloat16"], grads)] * (
            workers.DS_SENDS_STEPS)
        assert run["skipped"] == 0
    for a, b, p0 in zip(sends[0]["params"], sends[1]["params"], sends[0]["initial"]):
        assert torch.equal(a, b) and not torch.equal(a, p0)  # both ranks applied the same bfloat16-reduced step
