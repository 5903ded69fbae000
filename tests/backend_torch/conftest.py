"""Shared helpers for the torch backend tests (fixtures: tests import each other under importlib mode).

- ``tiny``: the transformer-ish model of the parity tests, and ``native_forward`` (hand-written
  torch.amp: autocast + ``autocast(enabled=False)`` around the pinned modules);
- ``probe``: an independent recorder of the dtype every module really computes in (module hooks
  for the module stack, a dispatch mode for the aten ops each module runs itself);
- ``counter``: exact counts of host syncs (``aten._local_scalar_dense``: ``.item()``, ``bool()``)
  and casts (``aten._to_copy``) in a block of code.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import importlib.util

import pytest

HAVE_TORCH = importlib.util.find_spec("torch") is not None

# Without torch nothing is defined here: each test module's ampbridge._testing.require("torch")
# then skips it, or fails it when AMPBRIDGE_REQUIRE asks for torch (so CI cannot pass by skipping).
if HAVE_TORCH:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    nn = torch.nn

    class Tiny(nn.Module):
        """Embedding, LayerNorm, MultiheadAttention, MLP, head: post-residual pre-norm blocks."""

        def __init__(self, vocab=32, d=16, heads=2):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.ln1 = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 2 * d)
            self.act = nn.GELU()
            self.fc2 = nn.Linear(2 * d, d)
            self.ln3 = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens):
            h = self.ln1(self.embed(tokens))
            a, _ = self.attn(h, h, h, need_weights=False)
            h = h + a
            h = h + self.fc2(self.act(self.fc1(self.ln2(h))))
            return self.head(self.ln3(h))


    def native_forward(m, tokens, dtype, pinned=True):
        """The same forward written by hand with torch.amp (norms and embedding pinned when ``pinned``)."""
        with torch.autocast("cpu", dtype=dtype):
            if pinned:
                with torch.autocast("cpu", enabled=False):
                    h = m.ln1(m.embed(tokens).float())
            else:
                h = m.ln1(m.embed(tokens))
            a, _ = m.attn(h, h, h, need_weights=False)
            h = h + a
            if pinned:
                with torch.autocast("cpu", enabled=False):
                    x = m.ln2(h.float())
            else:
                x = m.ln2(h)
            h = h + m.fc2(m.act(m.fc1(x)))
            if pinned:
                with torch.autocast("cpu", enabled=False):
                    x = m.ln3(h.float())
            else:
                x = m.ln3(h)
            out = m.head(x)
        return out.float()


    def batches(n, seed=1, vocab=32, shape=(4, 8)):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
                for _ in range(n)]


    @pytest.fixture
    def tiny():
        torch.manual_seed(0)
        return Tiny()


    @contextlib.contextmanager
    def big_weights(layer, factor):
        """``layer.weight`` multiplied by ``factor`` inside the block (an overflow planted at one step)."""
        saved = layer.weight.detach().clone()
        with torch.no_grad():
            layer.weight.mul_(factor)
        try:
            yield
        finally:
            with torch.no_grad():
                layer.weight.copy_(saved)


    @pytest.fixture
    def helpers():
        return collections.namedtuple("Helpers", "Tiny native_forward batches twin big_weights")(
            Tiny, native_forward, batches, lambda m: (m, copy.deepcopy(m)), big_weights)


    # --- the independent dtype probe -----------------------------------------------------------------

    MAIN_OPS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "native_layer_norm", "native_group_norm",
                "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "_softmax",
                "_log_softmax", "embedding", "_embedding_bag", "mkldnn_rnn_layer", "_trilinear", "gelu",
                "_grouped_mm", "grouped_mm"}  # MoE experts (transformers' grouped_mm): a matmul autocast leaves alone
    CAST_OPS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "linear", "matmul"}
    NOT_COMPUTE = {"_to_copy", "copy_", "detach", "empty", "empty_like", "zeros", "zeros_like", "ones", "full",
                   "arange", "lift_fresh", "clone", "t", "view", "transpose", "expand", "unsqueeze", "squeeze",
                   "permute", "select", "slice", "alias", "_unsafe_view", "split", "unbind", "reshape",
                   "repeat", "stack", "cat", "unsafe_split", "split_with_sizes", "chunk"}


    class Probe:
        """What each module of a model really computed in, seen from the dispatcher.

        ``main[path]``: dtypes of the main ops (matmul, conv, norm, softmax, embedding) the module ran
        itself; ``last[path]``: dtype of its last computing op; ``region[path]``: autocast dtype its
        children were called in; ``fed[path]``: dtype of its first floating input, as fed to it.
        """

        def __init__(self, model, device_type="cpu"):
            self.paths = {id(m): p for p, m in model.named_modules()}
            self.device_type = device_type
            self.stack, self.main, self.last = [], collections.defaultdict(list), {}
            self.cast_ops = collections.defaultdict(list)  # path -> dtypes of its matmuls and convolutions
            self.region, self.fed, self.out, self.ran = {}, {}, {}, set()
            probe = self

            class Mode(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    out = func(*args, **(kwargs or {}))
                    name = func.overloadpacket.__name__
                    first = out[0] if isinstance(out, (tuple, list)) and out else out
                    if probe.stack and name not in NOT_COMPUTE and isinstance(first, torch.Tensor) \
                            and first.is_floating_point():
                        top = probe.stack[-1]
                        probe.last[top] = first.dtype
                        if name in MAIN_OPS:
                            probe.main[top].append(first.dtype)
                        if name in CAST_OPS:
                            probe.cast_ops[top].append(first.dtype)
                    return out

            self.mode = Mode()

        def _pre(self, module, args):
            path = self.paths.get(id(module))
            if path is None:
                return
            if self.stack:
                on = torch.is_autocast_enabled(self.device_type)
                self.region.setdefault(self.stack[-1], torch.get_autocast_dtype(self.device_type) if on else torch.float32)
            floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            self.fed.setdefault(path, floats[0].dtype if floats else None)
            self.stack.append(path)
            self.ran.add(path)

        def _post(self, module, args, out):
            path = self.paths.get(id(module))
            if path is not None:
                self.stack.pop()
                first = out[0] if isinstance(out, (tuple, list)) and out else out
                if isinstance(first, torch.Tensor) and first.is_floating_point():
                    self.out.setdefault(path, first.dtype)

        def __enter__(self):
            self.hooks = [nn.modules.module.register_module_forward_pre_hook(self._pre),
                          nn.modules.module.register_module_forward_hook(self._post, always_call=True)]
            self.mode.__enter__()
            return self

        def __exit__(self, *exc):
            self.mode.__exit__(*exc)
            for h in self.hooks:
                h.remove()

        def computed(self, path):
            """The set of dtypes the module at ``path`` computed in (None: it did not compute)."""
            if self.main.get(path):
                return set(self.main[path])
            if path in self.region:
                return {self.region[path]}
            return {self.last[path]} if path in self.last else None


    def check_plan(plan, probe, ignore=(), model=None):
        """Every row that ran computed in its Plan dtype (rows that follow their input: in their input's)
        and delivered its Plan output dtype (a container ampbridge does not wrap delivers what its
        last layer returns, so only wrapped containers are checked)."""
        wrapped = {p for p, m in model.named_modules() if "forward" in m.__dict__} if model is not None else set()
        names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
        checked, problems = 0, []
        for row in plan.rows:
            if row.path in ignore:
                continue
            if row.path not in probe.ran:
                assert row.note and "used by" in row.note, f"{row.path} did not run and its row does not say why"
                continue
            got = probe.computed(row.path)
            if got is None:
                continue
            got = {names[d] for d in got}
            want = {row.compute_dtype}
            want_out = row.output_dtype
            if row.note and row.note.startswith("follows its input's dtype"):
                want = {names[probe.fed[row.path]]}
            if row.note and "its input's dtype" in row.note and "when fed by" in row.note:
                want_out = names[probe.fed[row.path]]
            if row.note and row.note.startswith("custom module:"):  # the row claims its matmuls/convs only
                got = {names[d] for d in probe.cast_ops.get(row.path, ())} or want
                want_out = None
            if got != want:
                problems.append(f"{row.path} ({row.class_name}): plan {want}, ran {got}")
            out = probe.out.get(row.path)
            if row.path in probe.region and row.path not in wrapped:
                out = None
            if out is not None and want_out is not None and names[out] != want_out:
                problems.append(f"{row.path} ({row.class_name}): plan output {want_out}, delivered {names[out]}")
            checked += 1
        assert not problems, "\n".join(problems)
        return checked


    @pytest.fixture
    def probe():
        return collections.namedtuple("ProbeKit", "Probe check_plan")(Probe, check_plan)


    # --- exact counts --------------------------------------------------------------------------------

    class Counter(TorchDispatchMode):
        """Counts aten ops by name; ``syncs`` = host reads (``_local_scalar_dense``), ``casts`` = ``_to_copy``."""

        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

        @property
        def syncs(self):
            return self.ops["_local_scalar_dense"]

        @property
        def casts(self):
            return self.ops["_to_copy"]


    @pytest.fixture
    def counter():
        return Counter
