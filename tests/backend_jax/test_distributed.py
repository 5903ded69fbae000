"""Data parallel on 2 host devices (``--xla_force_host_platform_device_count=2``, set before JAX
is imported, so every run is a subprocess of this file): the gradient all-reduce in
``reduce_dtype`` (the lowered HLO's element type), an overflow on one device's shard only and a
gradient made inf on one device after the reduction (both devices skip both steps), the
loss-scale trajectory equal to the core reference, and the parameters equal to one device on the
same global batch. Then the same under ``jax.distributed.initialize`` with 2 processes.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

if __name__ == "__main__":  # a worker: the repository's ampbridge
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ampbridge._testing import require  # noqa: E402

require("jax")
require("optax")

HERE = os.path.abspath(__file__)
STEPS = 6
SHARD_OVERFLOW = 2  # step whose batch overflows on device 1's shard only (before the reduction)
LATE_OVERFLOW = 4  # step whose gradient device 1 alone makes inf after the reduction
# max |params - one device's| after 6 steps. float32: the reduction order (a mean of 2 shard
# means vs one mean), measured 3e-8. bfloat16: each shard's gradient rounded to 8 bits before the
# sum, so relative to the parameters' largest movement (0.11): 1% of it, measured 0.25%
TOLERANCE = {"float32": lambda moved: 1e-6, "bfloat16": lambda moved: 1e-2 * moved}


def _env(devices: int = 2) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _run(*args: str, timeout: int = 120) -> dict:
    out = subprocess.run([sys.executable, HERE, *args], env=_env(), capture_output=True, text=True,
                         timeout=timeout, cwd=os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single_host() -> dict:
    return _run("single_host")


# --- the worker (runs in the subprocess) ---------------------------------------------------------

def _policy(reduce_dtype: str):
    import ampbridge

    return ampbridge.Policy(reduce_dtype=reduce_dtype, loss_scale={"mode": "dynamic", "initial_scale": 1024.0,
                                                                   "growth_interval": 2})


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(3, 8)).astype(np.float32), "b1": np.zeros(8, np.float32),
              "w2": rng.normal(size=(8, 2)).astype(np.float32)}
    xs = rng.normal(size=(STEPS, 8, 3)).astype(np.float32)
    ys = rng.normal(size=(STEPS, 8, 2)).astype(np.float32)
    ys[SHARD_OVERFLOW, 6, 0] = 3e38  # row 6: device 1's half of the global batch of 8 (loss inf)
    return params, xs, ys


def _loss(p, x, y):
    import jax.numpy as jnp

    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _late_inf(grads, inject):
    import jax.numpy as jnp

    return {**grads, "w2": jnp.where(inject, jnp.inf, grads["w2"])}


def _shard_map_run(reduce_dtype: str, agree: bool):
    """Train STEPS steps in shard_map; per step, each device's params and loss-scale state."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ampbridge

    policy = _policy(reduce_dtype)
    tx = ampbridge.jax.optimizer(optax.sgd(0.05), policy, axis_name="data" if agree else None)
    mesh = jax.make_mesh((2,), ("data",))
    params, xs, ys = _data()
    opt_state = tx.init(params)

    def local(params, opt_state, x, y, step):
        mine = jax.tree_util.tree_map(lambda p: jax.lax.pcast(p, "data", to="varying"), params)
        _, grads = ampbridge.jax.value_and_grad(_loss, opt_state)(mine, x, y)
        grads = ampbridge.jax.distributed.pmean_grads(grads, "data", policy)
        grads = _late_inf(grads, (jax.lax.axis_index("data") == 1) & (step == LATE_OVERFLOW))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # each device's own copy, stacked: whether they agree is what is tested
        return jax.tree_util.tree_map(lambda a: a[None], (params, opt_state))

    step_fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data"), P("data"), P()),
                                    out_specs=P("data")))
    params, opt_state = ampbridge.jax.distributed.replicate((params, opt_state), mesh)
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P(None, "data"))) for a in (xs, ys))
    per_step = []
    for step in range(STEPS):
        both_params, both_state = jax.device_get(step_fn(params, opt_state, xs[step], ys[step], jnp.int32(step)))
        states = [ampbridge.jax.loss_scale(jax.tree_util.tree_map(lambda a: a[i], both_state)).to_reference()
                  for i in range(2)]
        per_step.append({"states": [s.to_dict() for s in states],
                         "params_equal": all(bool(np.array_equal(a[0], a[1]))
                                             for a in jax.tree_util.tree_leaves(both_params))})
        # carry device 0's copy forward (identical to device 1's when they agree)
        params, opt_state = ampbridge.jax.distributed.replicate(jax.tree_util.tree_map(lambda a: a[0], (both_params, both_state)),
                                                    mesh)
    hlo = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data"), P("data"), P()),
                                out_specs=P("data"))).lower(params, opt_state, xs[0], ys[0], jnp.int32(0))
    return jax.device_get(params), per_step, _all_reduce_types(hlo.as_text(dialect="hlo"))


def _all_reduce_types(hlo_text: str) -> list[list]:
    """(element type, shape) of every all-reduce in an HLO module's text."""
    found = []
    for line in hlo_text.splitlines():
        m = re.search(r"=\s*(\(.*?\)|\S+)\s+all-reduce(?:-start)?\(", line)  # one type or a tuple
        if m:
            found.extend([t, shape] for t, shape in re.findall(r"([a-z][a-z0-9]*)\[([0-9,]*)\]", m.group(1)))
    return found


def _single_device_run(reduce_dtype: str):
    import jax
    import jax.numpy as jnp
    import optax

    import ampbridge

    policy = _policy(reduce_dtype)
    tx = ampbridge.jax.optimizer(optax.sgd(0.05), policy)
    params, xs, ys = _data()
    opt_state = tx.init(params)

    @jax.jit
    def step_fn(params, opt_state, x, y, step):
        _, grads = ampbridge.jax.value_and_grad(_loss, opt_state)(params, x, y)
        grads = _late_inf(grads, step == LATE_OVERFLOW)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for step in range(STEPS):
        params, opt_state = step_fn(params, opt_state, xs[step], ys[step], jnp.int32(step))
    return jax.device_get(params), ampbridge.jax.loss_scale(opt_state).to_reference().to_dict()


def _sharded_jit(reduce_dtype: str):
    """data_parallel_value_and_grad in a jit over NamedSharding inputs; and a plain sharded jit."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ampbridge

    policy = _policy(reduce_dtype)
    tx = ampbridge.jax.optimizer(optax.sgd(0.05), policy)
    mesh = jax.make_mesh((2,), ("data",))
    params, xs, ys = _data()
    params = ampbridge.jax.distributed.replicate(params, mesh)
    opt_state = ampbridge.jax.distributed.replicate(tx.init(params), mesh)
    batch = NamedSharding(mesh, P("data"))

    def step_fn(params, opt_state, x, y):
        _, grads = ampbridge.jax.distributed.data_parallel_value_and_grad(_loss, opt_state, mesh, policy)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def plain_fn(params, opt_state, x, y):
        _, grads = ampbridge.jax.value_and_grad(_loss, opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(step_fn)
    for i in range(STEPS):
        if i == LATE_OVERFLOW:
            continue  # (no per-device injection here: the global view has no "device 1 only")
        params, opt_state = step(params, opt_state, jax.device_put(xs[i], batch), jax.device_put(ys[i], batch))
    x0, y0 = jax.device_put(xs[0], batch), jax.device_put(ys[0], batch)
    lowered = _all_reduce_types(step.lower(params, opt_state, x0, y0).as_text(dialect="hlo"))
    plain = _all_reduce_types(jax.jit(plain_fn).lower(params, opt_state, x0, y0).compile().as_text())
    states = ampbridge.jax.loss_scale(opt_state).to_reference().to_dict()
    return ({k: np.asarray(v).tolist() for k, v in jax.device_get(params).items()}, states, lowered, plain)


def _worker_single_host() -> dict:
    import jax
    import numpy as np

    assert jax.device_count() == 2, jax.devices()
    out = {}
    for reduce_dtype in ("float32", "bfloat16"):
        params, per_step, types = _shard_map_run(reduce_dtype, agree=True)
        ref_params, ref_state = _single_device_run(reduce_dtype)
        start = _data()[0]
        moved = max(float(np.max(np.abs(ref_params[k] - start[k]))) for k in start)
        diff = max(float(np.max(np.abs(params[k] - ref_params[k]))) for k in params)
        out[reduce_dtype] = {"per_step": per_step, "hlo": types, "ref_state": ref_state,
                             "diff": diff, "moved": moved,
                             "ref_params": {k: np.asarray(v).tolist() for k, v in ref_params.items()}}
        jit_params, jit_state, lowered, plain = _sharded_jit(reduce_dtype)
        out[reduce_dtype]["jit"] = {"state": jit_state, "hlo": lowered, "plain_hlo": plain}
    _, disagree, _ = _shard_map_run("float32", agree=False)  # the control: no agreement
    out["no_agreement"] = disagree
    return out


def _worker_process(process_id: int, port: int) -> dict:
    """One of 2 processes (1 CPU device each) under jax.distributed.initialize."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               local_device_ids=[0])
    try:
        import numpy as np
        import optax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        import ampbridge

        assert jax.device_count() == 2 and jax.local_device_count() == 1
        policy = _policy("bfloat16")
        tx = ampbridge.jax.optimizer(optax.sgd(0.05), policy, axis_name="data")
        mesh = jax.make_mesh((2,), ("data",))
        params, xs, ys = _data()
        opt_state = tx.init(params)
        half = slice(4 * process_id, 4 * process_id + 4)  # this process's shard of the global batch

        def local(params, opt_state, x, y, step):
            _, grads = ampbridge.jax.value_and_grad(_loss, opt_state)(params, x, y)
            grads = ampbridge.jax.distributed.pmean_grads(grads, "data", policy)
            grads = _late_inf(grads, (jax.lax.axis_index("data") == 1) & (step == LATE_OVERFLOW))
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        step_fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data"), P("data"), P()),
                                        out_specs=P(), check_vma=False))
        rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

        def global_array(local_value, sharding, shape):
            return jax.make_array_from_process_local_data(sharding, local_value, shape)

        params = jax.tree_util.tree_map(lambda a: global_array(a, rep, a.shape), params)
        opt_state = jax.tree_util.tree_map(lambda a: global_array(np.asarray(a), rep, np.shape(a)), opt_state)
        states = []
        for step in range(STEPS):
            x = global_array(xs[step][half], batch, xs[step].shape)
            y = global_array(ys[step][half], batch, ys[step].shape)
            params, opt_state = step_fn(params, opt_state, x, y, global_array(np.int32(step), rep, ()))
            states.append(ampbridge.jax.loss_scale(jax.tree_util.tree_map(
                lambda a: a.addressable_data(0), opt_state)).to_reference().to_dict())
        local_params = {k: np.asarray(v.addressable_data(0)).tolist() for k, v in params.items()}
        return {"states": states, "params": local_params}
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "single_host":
        result = _worker_single_host()
    else:
        result = _worker_process(int(sys.argv[2]), int(sys.argv[3]))
    print(json.dumps(result))
    sys.exit(0)


# --- the tests --------------------------------------------------------------------------------

def _expected_states() -> list[dict]:
    from ampbridge.core.loss_scale import trajectory

    cfg = _policy("float32").resolved_loss_scale
    flags = [step in (SHARD_OVERFLOW, LATE_OVERFLOW) for step in range(STEPS)]
    return [s.to_dict() for s in trajectory(cfg, flags)]


@pytest.mark.slow
@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_both_devices_skip_together_and_follow_the_reference(single_host, reduce_dtype):
    run = single_host[reduce_dtype]
    expected = _expected_states()
    assert [s["skipped"] for s in expected] == [0, 0, 1, 1, 2, 2]  # the two injected steps
    for step, got in enumerate(run["per_step"]):
        assert got["states"] == [expected[step], expected[step]], step  # every device, every step
        assert got["params_equal"], step  # the replicas never part
    assert run["ref_state"] == expected[-1]  # the single-device run skipped the same steps


@pytest.mark.slow
@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_params_equal_one_device_on_the_global_batch(single_host, reduce_dtype):
    run = single_host[reduce_dtype]
    assert run["moved"] > 1e-2  # the run trained
    assert run["diff"] <= TOLERANCE[reduce_dtype](run["moved"]), run


@pytest.mark.slow
@pytest.mark.parametrize("reduce_dtype,wire", [("float32", "f32"), ("bfloat16", "bf16")])
def test_the_gradient_all_reduce_runs_in_reduce_dtype(single_host, reduce_dtype, wire):
    run = single_host[reduce_dtype]
    param_shapes = {"3,8", "8", "8,2"}
    for types in (run["hlo"], run["jit"]["hlo"]):  # shard_map + pmean_grads; data_parallel_value_and_grad
        grads = [t for t, shape in types if shape in param_shapes]
        assert sorted(shape for t, shape in types if shape in param_shapes) == sorted(param_shapes), types
        assert set(grads) == {wire}, types
    # a plain sharded jit: XLA's own all-reduce, in the gradients' dtype whatever reduce_dtype says
    assert {t for t, shape in run["jit"]["plain_hlo"] if shape} <= {"f32"}, run["jit"]["plain_hlo"]
    # the sharded-jit helper trains: skipped the overflowed shard's step, as the reference does
    assert run["jit"]["state"]["skipped"] == 1 and run["jit"]["state"]["steps"] == STEPS - 1


@pytest.mark.slow
def test_without_agreement_a_late_overflow_parts_the_replicas(single_host):
    """The control: without axis_name, device 1 skips the late overflow alone."""
    run = single_host["no_agreement"]
    late = run[LATE_OVERFLOW]
    assert late["states"][0]["skipped"] == 1 and late["states"][1]["skipped"] == 2
    assert not late["params_equal"]
    assert all(s["params_equal"] for s in run[:LATE_OVERFLOW])


@pytest.mark.slow
def test_pmean_grads_without_devices():
    """Doc-level behaviour on one device (vmap axis): dtypes kept, ints passed through."""
    import jax
    import jax.numpy as jnp

    import ampbridge

    policy = ampbridge.Policy(reduce_dtype="bfloat16")
    tree = {"w": jnp.array([[1.0, 2.0], [3.0, 5.0]], jnp.float32), "n": jnp.array([1, 2])}
    out = jax.vmap(lambda t: ampbridge.jax.distributed.pmean_grads(t, "d", policy), axis_name="d")(tree)
    assert out["w"].dtype == jnp.float32 and out["w"].tolist() == [[2.0, 3.5], [2.0, 3.5]]
    assert out["n"].tolist() == [1, 2]
    note = ampbridge.jax.resolve_policy(policy)[1]
    assert any("reduce_dtype bfloat16" in n and "pmean_grads" in n for n in note)
    assert not ampbridge.jax.resolve_policy(ampbridge.Policy())[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_with_jax_distributed_initialize(single_host):
    """Multi-controller: 2 processes, 1 CPU device each, gloo on 127.0.0.1; shard_map with
    check_vma=False (local gradients, pmap's semantics), reduce_dtype bfloat16."""
    port = _free_port()
    env = _env(devices=1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
    procs = [subprocess.Popen([sys.executable, HERE, "process", str(i), str(port)], env=env, cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-4000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    expected = _expected_states()
    for r in results:
        assert r["states"] == expected
    assert results[0]["params"] == results[1]["params"]  # bit for bit: the processes never part
    import numpy as np

    run = single_host["bfloat16"]
    for k, v in run["ref_params"].items():
        diff = float(np.max(np.abs(np.asarray(results[0]["params"][k]) - np.asarray(v))))
        assert diff <= TOLERANCE["bfloat16"](run["moved"]), (k, diff)


@pytest.mark.slow
def test_pmean_grads_refuses_gradients_shard_map_already_reduced():
    """Under shard_map's default check_vma, the gradient of a replicated parameter is already an
    all-reduce in its own dtype: pmean_grads says so rather than reduce again (one device)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import ampbridge
    from ampbridge.errors import UnsupportedOptionError

    policy = ampbridge.Policy(reduce_dtype="bfloat16")
    mesh = jax.make_mesh((1,), ("data",))

    def local(w, x, pcast):
        w_local = jax.lax.pcast(w, "data", to="varying") if pcast else w
        grads = jax.grad(lambda w: jnp.sum(x @ w))(w_local)
        return ampbridge.jax.distributed.pmean_grads({"w": grads}, "data", policy)["w"]

    run = [jax.shard_map(lambda w, x, c=c: local(w, x, c), mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
           for c in (False, True)]
    w, x = jnp.ones((2,)), jax.device_put(jnp.ones((3, 2)), jax.sharding.NamedSharding(mesh, P("data")))
    with pytest.raises(UnsupportedOptionError, match=r"\['w'\] is already reduced over 'data'.*pcast"):
        run[0](w, x)
    assert run[1](w, x).tolist() == [3.0, 3.0]
