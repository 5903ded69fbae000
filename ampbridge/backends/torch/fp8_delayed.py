"""FP8 delayed scaling on torch: ampbridge's own, on torch's float8 dtypes (torchao has none).

:class:`DelayedFloat8Linear` replaces a float8 ``nn.Linear`` (the same ``Parameter`` objects) and
follows :func:`ampbridge.core.fp8.delayed_step` step for step, per tensor (input, weight, output
gradient): a float32 divisor and an amax history, kept as buffers so ``state_dict()`` checkpoints
them. The timing is Transformer Engine's and Flax's (``fp8_ops.in_qdq``): step t computes its
divisor from the history *before* step t's amax, quantizes with it, then records the amax. The
float32 arithmetic is Flax's (``compute_scale``, ``quantize``/``dequantize``), as torch computes it:
**with subnormals** (``core.fp8``'s ``flush_denormals=False``, as Keras on its torch backend).

The float8 casts are real (``x / divisor``, clipped to the format's max, cast to
``torch.float8_e4m3fn``/``float8_e5m2`` and back times the divisor, in float32); the products run
as torchao's ``emulate=True`` runs them: in float32 on the dequantised values, each rounded to the
autocast dtype (or the input's dtype without autocast), on every device (no float8 GEMM).

The state, as public buffers (the monitors read them): ``input_divisor``, ``input_amax_history``,
``weight_divisor``, ``weight_amax_history``, ``grad_output_divisor``, ``grad_output_amax_history``
(a history is newest first). A forward in training mode with gradients on moves the input and
weight state, a backward the output-gradient state; otherwise (eval, ``torch.no_grad``) the forward
quantizes with the divisor the next step would compute and stores nothing (as Flax without
``apply_gradients``, Keras with ``training=False``).

Example:
    >>> lin = DelayedFloat8Linear.from_linear(nn.Linear(2, 1), amax_history=4)
    >>> _ = lin(torch.ones(1, 2)).sum().backward()
    >>> lin.input_amax_history.tolist(), lin.input_divisor.item()
    ([1.0, 0.0, 0.0, 0.0], 1.0)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
TENSORS = ("input", "weight", "grad_output")


def qdq(x: torch.Tensor, divisor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` through ``dtype`` at ``divisor`` and back, in float32 (Flax's ``quantize`` then ``dequantize``).

    Example:
        >>> qdq(torch.tensor([1000.0, 0.3]), torch.tensor(1.0), torch.float8_e4m3fn).tolist()
        [448.0, 0.3125]
    """
    top = torch.finfo(dtype).max
    q = (x.float() / divisor).clamp(-top, top).to(dtype)
    return q.float() * divisor


def next_divisor(divisor: torch.Tensor, history: torch.Tensor, fmt_max: float, margin: int = 0,
                 amax_compute: str = "max") -> torch.Tensor:
    """The divisor of this step, from the history before it (Flax's ``compute_scale``, float32).

    Example:
        >>> next_divisor(torch.tensor(1.0), torch.tensor([2.0, 0.0]), 448.0) == torch.tensor(1 / 224)
        tensor(True)
    """
    amax = history.max() if amax_compute == "max" else history[0]
    # tensor / tensor: a Python number over a tensor is a reciprocal times the number in torch
    sf = torch.full_like(divisor, fmt_max) / amax / 2.0 ** margin  # 2**margin: exact either way
    keep = torch.ones_like(divisor) / divisor
    sf = torch.where((amax > 0.0) & torch.isfinite(amax), sf, keep)
    return torch.ones_like(divisor) / sf


def record(history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The history after this step: rolled one towards the front, entry 0 this step's amax."""
    out = torch.roll(history, -1, 0)
    out[0] = amax
    return out


class _Matmul(torch.autograd.Function):
    """``x @ weight.T`` on the quantize-dequantized operands; the backward quantizes the output gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, layer: "DelayedFloat8Linear",
                out_dtype: torch.dtype, store: bool) -> torch.Tensor:
        fmt = FORMATS[layer.forward_format]
        xq = qdq(x.reshape(-1, x.shape[-1]), layer.advance("input", x, store), fmt)
        wq = qdq(weight, layer.advance("weight", weight, store), fmt)
        ctx.save_for_backward(xq, wq)
        ctx.layer, ctx.x_meta, ctx.w_dtype = layer, (x.shape, x.dtype), weight.dtype
        with torch.autocast(x.device.type, enabled=False):  # the product in float32, as torchao emulates it
            out = (xq @ wq.t()).to(out_dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        xq, wq = ctx.saved_tensors
        layer, (x_shape, x_dtype) = ctx.layer, ctx.x_meta
        g = grad.reshape(-1, grad.shape[-1])
        gq = qdq(g, layer.advance("grad_output", g, store=True), FORMATS[layer.backward_format])
        grad_x = grad_w = None
        with torch.autocast(grad.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (gq @ wq).to(grad.dtype).to(x_dtype).reshape(x_shape)
            if ctx.needs_input_grad[1]:
                grad_w = (gq.t() @ xq).to(grad.dtype).to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None


class DelayedFloat8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmul runs on float8 values under ampbridge's delayed scaling.

    Build it with :meth:`from_linear` (it takes the layer's own parameters); the keyword settings
    are the ``[fp8]`` table's (``forward``, ``backward``, ``amax_history``, ``amax_compute``, ``margin``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, forward: str = "e4m3",
                 backward: str = "e5m2", amax_history: int = 1024, amax_compute: str = "max", margin: int = 0,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.forward_format, self.backward_format = forward, backward
        self.amax_history, self.amax_compute, self.margin = amax_history, amax_compute, margin
        state_device = None if self.weight.is_meta else self.weight.device
        self._make_state(state_device)

    def _make_state(self, device: Any) -> None:
        for name in TENSORS:  # Flax's and Keras's start: divisor 1, a zero history
            self.register_buffer(f"{name}_divisor", torch.ones((), dtype=torch.float32, device=device))
            self.register_buffer(f"{name}_amax_history",
                                 torch.zeros(self.amax_history, dtype=torch.float32, device=device))

    @classmethod
    def from_linear(cls, linear: nn.Linear, **settings: Any) -> "DelayedFloat8Linear":
        """A float8 layer holding ``linear``'s own ``weight`` and ``bias`` (optimizers keep working)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, **settings)
        new.weight, new.bias = linear.weight, linear.bias
        new._make_state(linear.weight.device)
        new.train(linear.training)
        return new

    @property
    def settings(self) -> dict[str, Any]:
        """The ``[fp8]`` settings this layer realises (a change of any rebuilds it, fresh state)."""
        return {"forward": self.forward_format, "backward": self.backward_format, "amax_history": self.amax_history,
                "amax_compute": self.amax_compute, "margin": self.margin}

    @torch.no_grad()
    def advance(self, name: str, tensor: torch.Tensor, store: bool) -> torch.Tensor:
        """This step's divisor for ``name`` (from the history before it); with ``store`` it is kept and
        ``tensor``'s amax recorded."""
        divisor, history = getattr(self, f"{name}_divisor"), getattr(self, f"{name}_amax_history")
        if divisor.dtype != torch.float32 or history.dtype != torch.float32:  # e.g. after model.to(torch.bfloat16)
            raise TypeError(f"{name}_divisor/{name}_amax_history of a DelayedFloat8Linear are {divisor.dtype}/"
                            f"{history.dtype}; the float8 state must stay torch.float32 (cast the parameters only, "
                            f"or let the policy's param_dtype do it)")
        fmt = self.backward_format if name == "grad_output" else self.forward_format
        new = next_divisor(divisor, history, torch.finfo(FORMATS[fmt]).max, self.margin, self.amax_compute)
        if store:
            history.copy_(record(history, tensor.detach().abs().max().float()))
            divisor.copy_(new)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device = input.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else input.dtype
        store = self.training and torch.is_grad_enabled()  # a no_grad or eval forward moves no state
        weight = self.weight
        if torch.is_autocast_enabled(device):
            # the operands in the compute dtype before their amax and quantization, as Keras's float8 Dense
            # and Flax's Dense (promote_dtype) take them, and torchao its input: the same amaxes, hence scales
            input, weight = input.to(out_dtype), weight.to(out_dtype)
        out = _Matmul.apply(input, weight, self, out_dtype, store)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, fp8={self.forward_format}/{self.backward_format} delayed, "
                f"amax_history={self.amax_history}, amax_compute={self.amax_compute}, margin={self.margin}")
