"""Autograd at the ops' boundary: attnjit's kernels have no backward pass, and saying so beats a silent zero.

An op called with grad mode on and an input that requires grad (q of a training step) returns its outputs with a
grad_fn whose backward raises, so ``loss.backward()`` through attention fails with the reason instead of leaving
q, k and v without gradients. Under ``torch.no_grad()`` / ``torch.inference_mode()``, or with inputs that do not
require grad (every serving engine), the outputs are returned as they are: the check is two attribute reads.

Inside a ``torch.ops.attnjit`` op body (ops/library.py) the eager code runs under no_grad: the dispatcher has
already passed autograd there (the ops register none), so the guard stays out of it.
"""

from __future__ import annotations

from typing import Any

import torch

NO_BACKWARD = ("attnjit's attention kernels have no backward pass: a gradient cannot flow through {op}. Run "
               "inference under torch.no_grad() or torch.inference_mode(); train with an implementation that has a "
               "backward (torch SDPA, FlashAttention)")


class _NoBackward(torch.autograd.Function):
    """The outputs (detached aliases: no copy) of an op that has no backward, attached to its differentiable inputs
    so that a backward through them raises NO_BACKWARD."""

    @staticmethod
    def forward(ctx, op: str | type, n_out: int, *tensors: torch.Tensor):
        ctx.op = op
        outs = tuple(t.detach() for t in tensors[:n_out])
        return outs if n_out > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        op = f"{ctx.op.__name__}.run()" if isinstance(ctx.op, type) else ctx.op   # a wrapper class: its run()
        raise RuntimeError(NO_BACKWARD.format(op=op))


def guard(op: str | type, result: Any, *inputs: Any) -> Any:
    """``result`` (a tensor or a tuple of tensors) as it is, or, when grad mode is on and an input tensor requires
    grad, its tensors tied to those inputs by a backward that raises (see the module docstring). ``op``: the op's
    name, or a wrapper class (named with its run() only if the error is raised)."""
    if not torch.is_grad_enabled():
        return result
    needs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not needs:
        return result
    outs = result if isinstance(result, tuple) else (result,)
    tied = _NoBackward.apply(op, len(outs), *outs, *needs)
    if not isinstance(result, tuple):
        return tied
    return tied if len(outs) > 1 else (tied,)
