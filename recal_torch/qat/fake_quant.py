"""Fake quantization that never waits for the device.

torch's ``fake_quantize_per_channel_affine`` and its ``_fake_quantize_learnable_*`` ops read their zero points back
to the host (``.item()``) to check or round them: on a GPU each call stalls until the device catches up, so a QAT
step cannot queue its kernels ahead (measured on an H200: every weight quantizer of every step waited). This is the
same arithmetic from tensors alone: ``round(x * (1 / scale))`` to nearest even, plus the zero point, clamped to the
grid, back to float; the gradient passes straight through inside the grid, and, to a learned scale, LSQ's
(``round(x / s) - x / s`` inside, the grid's ends outside, times ``grad_factor``). Values are bit for bit torch's
(the tests compare them); the grid is computed in float32 and returned in ``x``'s dtype (bf16 under autocast).
"""

from __future__ import annotations

import torch


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin, qmax, grad_factor):
        inv = 1.0 / scale
        xf = x.float()
        q = torch.round(xf * inv)
        if isinstance(zero_point, torch.Tensor):
            q = q + zero_point
            on_grid = q.clamp(qmin, qmax)
            levels = on_grid - zero_point
        else:  # a zero point of 0 (symmetric): two kernels fewer
            on_grid = levels = q.clamp(qmin, qmax)
        inside = on_grid == q
        if ctx.needs_input_grad[1]:
            ctx.save_for_backward(inside, levels - torch.where(inside, xf * inv, 0.0))
        else:
            ctx.save_for_backward(inside)
        ctx.scale_shape, ctx.grad_factor = scale.shape, grad_factor
        return (levels * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        inside = ctx.saved_tensors[0]
        dx = grad * inside
        dscale = None
        if ctx.needs_input_grad[1]:
            per_value = grad.float() * ctx.saved_tensors[1] * ctx.grad_factor
            dscale = per_value.sum_to_size(ctx.scale_shape)
        return dx, dscale, None, None, None, None


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | float, qmin: int, qmax: int,
                  grad_factor: float = 1.0) -> torch.Tensor:
    """``x`` on the grid ``(clamp(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale``.

    ``scale`` and ``zero_point`` broadcast against ``x`` (per channel: shaped ``[C, 1, ...]``); a ``scale`` that
    requires grad gets LSQ's gradient scaled by ``grad_factor``; the zero point is not learned."""
    if isinstance(zero_point, torch.Tensor):
        zero_point = zero_point.to(torch.float32)
    elif zero_point != 0:
        raise ValueError(f"a zero point given as a number must be 0, got {zero_point!r}")
    return _FakeQuantize.apply(x, scale, zero_point, qmin, qmax, grad_factor)


def per_channel(scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-output-channel ``scale`` (``[C]``) shaped to broadcast over ``like`` (``[C, ...]``)."""
    return scale.reshape(-1, *([1] * (like.dim() - 1)))
