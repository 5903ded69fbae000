"""Shared helpers for the JAX backend tests: jaxpr/HLO inspection, tiny models, batches."""

from __future__ import annotations

import re

import pytest

from ampbridge._testing import require

jax = require("jax")
require("flax")
require("optax")

import numpy as np  # noqa: E402

CALLBACK_PRIMITIVES = ("callback", "debug_callback", "io_callback", "pure_callback", "outside_call",
                       "host_callback")


def iter_eqns(jaxpr):
    """Every equation of a (closed) jaxpr, nested ones (pjit, scan, cond, custom_vjp) included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from iter_eqns(inner)


def callbacks_in(jaxpr, lowered_text: str) -> list[str]:
    """Host callbacks in a jaxpr and its lowered StableHLO text (empty: none)."""
    found = [e.primitive.name for e in iter_eqns(jaxpr) if any(c in e.primitive.name for c in CALLBACK_PRIMITIVES)]
    found += re.findall(r"custom_call @(\w*callback\w*)", lowered_text)
    found += re.findall(r"(send|recv|outfeed|infeed)[ (]", lowered_text)
    return found


def module_path_of(name_stack: str) -> str:
    """'jvp(DemoModel)/block/attn/query' -> 'block.attn.query' (the root's name dropped)."""
    parts = [re.sub(r"^\w+\((.*)\)$", r"\1", p) for p in name_stack.split("/") if p]
    while parts and re.match(r"^\w+\(", parts[0]):
        parts[0] = re.sub(r"^\w+\((.*)\)$", r"\1", parts[0])
    return ".".join(parts[1:])


@pytest.fixture(scope="session")
def demo():
    """The shared conformance model (Flax linen), its variables and a few batches."""
    from ampbridge.cli.demo.flax_model import build, loss_fn
    from ampbridge.cli.demo.model import batches

    model, variables = build()
    return model, variables, batches(30), loss_fn


def tree_bits_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):
        return False
    return all(np.asarray(x).dtype == np.asarray(y).dtype
               and np.array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8), np.atleast_1d(np.asarray(y)).view(np.uint8))
               for x, y in zip(la, lb))


@pytest.fixture
def bits_equal():
    return tree_bits_equal



class Inspect:
    """jaxpr / lowered-HLO facts about a function (what the tests assert on)."""

    @staticmethod
    def callbacks(fn, *args):
        jaxpr = jax.make_jaxpr(fn)(*args)
        text = jax.jit(fn).lower(*args).as_text()
        return callbacks_in(jaxpr, text)

    @staticmethod
    def dot_dtypes(fn, *args):
        """(module path, operand dtypes) of every dot_general/conv in ``fn``'s jaxpr."""
        out = []
        for eqn in iter_eqns(jax.make_jaxpr(fn)(*args)):
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                out.append((module_path_of(str(eqn.source_info.name_stack)),
                            tuple(str(v.aval.dtype) for v in eqn.invars)))
        return out

    @staticmethod
    def reduce_dtypes(fn, *args):
        out = []
        for eqn in iter_eqns(jax.make_jaxpr(fn)(*args)):
            if eqn.primitive.name.startswith("reduce_sum"):
                out.append((module_path_of(str(eqn.source_info.name_stack)),
                            tuple(str(v.aval.dtype) for v in eqn.invars)))
        return out


@pytest.fixture
def inspect():
    return Inspect()


def output_dtypes(fn, variables, x) -> dict[str, str]:
    """Each linen module's first floating output dtype in ``fn(variables, x)``, by module path, seen
    by flax's own method interceptor (outside ampbridge's)."""
    import jax.numpy as jnp
    from flax import linen as nn

    seen: dict[str, str] = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__":
            leaves = [t for t in jax.tree_util.tree_leaves(out) if jnp.issubdtype(t.dtype, jnp.floating)]
            seen.setdefault(".".join(context.module.path), str(leaves[0].dtype))
        return out

    with nn.intercept_methods(record):
        fn(variables, x)
    return seen


@pytest.fixture(scope="session")
def outputs():
    """:func:`output_dtypes` (session-scoped: hypothesis tests take it too)."""
    return output_dtypes
