"""policy -> tool -> policy for 100 seeded random policies and every target: each change is a named loss.

A change is any key where the policy read back differs from the one written (``recipes.differences``
over every field, the ``[kinds]`` table included, loss-scale keys one by one). It must be reported
as a loss of the write or the read named after that key (``loss_scale.growth_interval``, ``override``
for ``overrides``, ``phase`` for ``phases``), or after the source key the reader says it came from
(``fp16.loss_scale_window``). Loss-scale-only targets (GradScaler, Flax's DynamicScale) carry the
loss scale only and are compared on it; a jmp string holds no loss scale and is compared on the rest;
FSDP carries the dtypes and the pinned groups (its [[override]] keys spelled out).
Framework-free: no tool is imported, only its settings as plain data.
"""

from __future__ import annotations

import math
import random

import pytest

from ampbridge import LossScaleConfig, Policy, PolicyError, Rule, UnsupportedOptionError, recipes
from ampbridge.recipes.convert import POLICY_FIELDS

SEED, COUNT = 20261203, 100
DTYPES = ("float32", "float16", "bfloat16")
PATTERNS = ("kind:norm", "kind:embedding", "lm_head", "decoder.**.attn", "type:LayerNorm", "re:.*\\.proj$")
ALL_FIELDS = POLICY_FIELDS + ("kinds",)


def random_scale(rng: random.Random) -> dict:
    mode = rng.choice(["auto", "dynamic", "static", "none"])
    ls: dict = {"mode": mode, "skip_nonfinite": rng.random() < 0.7}
    if mode == "none":
        return ls
    ls["initial_scale"] = rng.choice([math.ldexp(1.0, rng.randint(-10, 40)), rng.uniform(0.5, 1e6), 1.0])
    if mode in ("auto", "dynamic"):
        ls.update(growth_factor=rng.choice([2.0, 2.0, 1.5, 1.1, 3.0]), backoff_factor=rng.choice([0.5, 0.5, 0.25]),
                  growth_interval=rng.choice([2000, 1000, 1, 7, 500]), hysteresis=rng.choice([1, 1, 2, 3]),
                  consecutive_hysteresis=rng.random() < 0.3, on_min_scale=rng.choice(["clamp", "warn", "error"]))
        if rng.random() < 0.4:
            ls["min_scale"] = rng.choice([1.0, 2.0**-10, 4.0])
        if rng.random() < 0.3:
            ls["max_scale"] = rng.choice([2.0**24, 2.0**40])
        if rng.random() < 0.3:  # DeepSpeed's window + 1 among others
            ls["first_growth_interval"] = ls["growth_interval"] + rng.choice([1, 1, 5, -0]) or 1
    if ls["skip_nonfinite"] and rng.random() < 0.2:
        ls["max_consecutive_skips"] = rng.choice([0, 1, 5])
    return ls


def random_policy(rng: random.Random) -> Policy:
    """One policy over every key the file holds (phases and the [kinds] table included), seeded."""
    while True:
        doc: dict = {"compute_dtype": rng.choice(DTYPES), "param_dtype": rng.choice(DTYPES),
                     "output_dtype": rng.choice(DTYPES), "loss_scale": random_scale(rng)}
        if rng.random() < 0.6:
            doc["reduce_dtype"] = rng.choice(DTYPES)
        if rng.random() < 0.3:
            doc["matmul_precision"] = rng.choice(["high", "medium"])
        if rng.random() < 0.4:
            doc["keep_float32"] = rng.sample(PATTERNS, rng.randint(1, 2))
        if rng.random() < 0.3:
            doc["override"] = [{"match": rng.choice(PATTERNS), rng.choice(["compute_dtype", "param_dtype",
                                                                           "output_dtype"]): rng.choice(DTYPES)}]
        if rng.random() < 0.15:
            doc["kinds"] = {"norm": ["MyRMSNorm"]}
        if rng.random() < 0.15:
            doc["phase"] = [{"until_epoch": 2, "compute_dtype": "float32"}, {}]
        try:
            return Policy.from_dict(doc)
        except PolicyError:
            continue


POLICIES = [random_policy(random.Random(SEED + i)) for i in range(COUNT)]


def read_fsdp(result: dict) -> recipes.Conversion:
    """FSDP's settings read back: the root group's dtypes, each pinned group as its keep_float32 entry or
    [[override]] (the label says which), from what FSDP2's MixedPrecisionPolicy and the groups hold."""
    root = result["root"]
    keep, rules = [], []
    for g in result["pinned"]:
        if g["label"].startswith("keep_float32"):
            assert (g["compute_dtype"], g["param_dtype"], g["output_dtype"]) == ("float32",) * 3
            keep += list(g["patterns"])
            continue
        rules.append(Rule(tuple(g["patterns"]), compute_dtype=g["fsdp2"]["param_dtype"],
                          param_dtype=g["param_dtype"], output_dtype=g["fsdp2"]["output_dtype"]))
    policy = Policy(compute_dtype=root["fsdp2"]["param_dtype"], param_dtype=root["param_dtype"],
                    output_dtype=root["fsdp2"]["output_dtype"], reduce_dtype=root["fsdp2"]["reduce_dtype"],
                    keep_float32=tuple(keep), overrides=tuple(rules))
    covers = {"compute_dtype", "param_dtype", "output_dtype", "reduce_dtype", "keep_float32", "overrides"}
    return recipes.Conversion(policy, covers=frozenset(covers))


def _scale_only(read):
    return lambda result: read(result) if result is not None else recipes.Conversion(
        LossScaleConfig(mode="none", skip_nonfinite=False), covers=frozenset({"loss_scale"}))


#: target -> (write, read back); every target recipes.write knows, DeepSpeed by ZeRO stage and by way
TARGETS = {
    **{f"deepspeed-zero{z}": (lambda p, z=z: recipes.to_deepspeed(p, stage=z),
                              lambda r, z=z: recipes.from_deepspeed({**r, "zero_optimization": {"stage": z}}))
       for z in range(4)},
    "deepspeed-0.17.0": (lambda p: recipes.to_deepspeed(p, stage=2, version="0.17.0"),
                         lambda r: recipes.from_deepspeed({**r, "zero_optimization": {"stage": 2}}, version="0.17.0")),
    "deepspeed-torch_autocast": (lambda p: recipes.to_deepspeed(p, via="torch_autocast"), recipes.from_deepspeed),
    "deepspeed-apex": (lambda p: recipes.to_deepspeed(p, via="amp"), recipes.from_deepspeed),
    "accelerate": (recipes.to_accelerate, lambda r: recipes.from_accelerate(
        {"distributed_type": "MULTI_GPU", "mixed_precision": r["mixed_precision"]},
        grad_scaler_kwargs=r["grad_scaler_kwargs"])),
    "lightning": (recipes.to_lightning,
                  lambda r: recipes.from_lightning(r["precision"], grad_scaler=r["grad_scaler"], api="fabric")),
    "lightning-1.9.5": (lambda p: recipes.to_lightning(p, lightning_version="1.9.5"),
                        lambda r: recipes.from_lightning(r["precision"], grad_scaler=r["grad_scaler"], api="fabric",
                                                         lightning_version="1.9.5")),
    "keras": (recipes.to_keras, lambda r: recipes.from_keras(r["dtype_policy"],
                                                             loss_scale_optimizer=r["loss_scale_optimizer"],
                                                             loss_scale_factor=r["loss_scale_factor"])),
    "tf_keras": (recipes.to_tf_keras, recipes.from_tf_keras),  # its reader takes what its writer writes
    "jmp": (recipes.to_jmp, recipes.from_jmp),
    "grad-scaler": (recipes.to_grad_scaler, _scale_only(recipes.from_grad_scaler)),
    "flax": (recipes.to_flax, _scale_only(recipes.from_flax)),
    "fsdp": (recipes.to_fsdp, read_fsdp),
}


def named(key: str, losses, origins) -> bool:
    """Is the change of ``key`` reported by a loss named after it, after the whole ``[loss_scale]`` table
    (a target that holds none), or after the source key the reader says it came from?"""
    names = {loss.setting for loss in losses}
    own = {"overrides": "override", "phases": "phase"}.get(key, key)
    origin = str(origins.get(key, "")).split(" ")[0]
    return own in names or (key.startswith("loss_scale.") and "loss_scale" in names) or bool(origin and
                                                                                            origin in names)


def resolved_rules(p: Policy) -> Policy:
    """The same policy with every [[override]] key spelled out (a key left out takes the policy's value; an
    output_dtype left out, the rule's compute dtype): FSDP's groups hold concrete dtypes."""
    rules = tuple(Rule(r.match, compute_dtype=r.compute_dtype or p.compute_dtype,
                       param_dtype=r.param_dtype or p.param_dtype,
                       output_dtype=r.output_dtype or r.compute_dtype or p.compute_dtype) for r in p.overrides)
    return p.replace(overrides=rules)


def changes(target: str, policy: Policy):
    """(key, written, read back, losses) for every change in one round trip; None when the target refuses."""
    write, read = TARGETS[target]
    try:
        out = write(policy)
    except UnsupportedOptionError:
        return None
    back = read(out.result)
    result = back.result
    # every key; a target that holds no loss scale (a jmp string) is not compared on it: its reader fills
    # the default, and its writer names the whole [loss_scale] table when the policy scales
    fields = tuple(f for f in ALL_FIELDS if f != "loss_scale" or f in back.covers)
    if isinstance(result, LossScaleConfig):
        result, fields = policy.replace(loss_scale=result), ("loss_scale",)
    elif target == "fsdp":
        policy, fields = resolved_rules(policy), tuple(back.covers)
    losses = out.losses + back.losses
    diffs = recipes.differences(policy, result, fields)
    return [(key, mine, theirs, losses, back.origins) for key, mine, theirs in diffs]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_change_is_a_loss_named_after_its_key(target):
    silent, refused, changed = [], 0, 0
    for i, policy in enumerate(POLICIES):
        found = changes(target, policy)
        if found is None:
            refused += 1
            continue
        changed += bool(found)
        for key, mine, theirs, losses, origins in found:
            if not named(key, losses, origins):
                silent.append(f"policy {i}: {key} {mine!r} -> {theirs!r}; losses: {[x.setting for x in losses]}")
    assert not silent, f"{target}: {len(silent)} silent changes:\n" + "\n".join(silent[:10])
    assert refused < COUNT  # the target was exercised (only compute_dtype 'auto' is refused, and none is drawn)


def test_the_policies_cover_every_key():
    """The 100 policies are not all alike: every key takes more than one value among them."""
    for key in ALL_FIELDS:
        assert len({repr(getattr(p, key)) for p in POLICIES}) > 1, key
