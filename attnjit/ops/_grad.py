"""Autograd at the ops' boundary: attnjit's kernels have no backward pass, and saying so beats a silent zero.

An op called with grad mode on and an input that requires grad (q of a training step) returns its outputs with a
grad_fn whose backward raises, so ``loss.backward()`` through attention fails with the reason instead of leaving
q, k and v without gradients. Under ``torch.no_grad()`` / ``torch.inference_mode()``, or with inputs that do not
require grad (every serving engine), the outputs are returned as they are: the check is two attribute reads.

Inside a ``torch.ops.attnjit`` op body (ops/library.py) the eager code runs with grad mode off (``grad_off``):
the dispatcher has already passed autograd there (the ops register none), so the guard stays out of it. The public
functions guard the op's outputs themselves, eager or compiled: without it a torch.ops op with no autograd kernel
gives only a warning and no gradient.
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


def _requiring_grad(inputs: tuple) -> list[torch.Tensor]:
    """The tensors among ``inputs`` (tensors, or tuples / lists / dicts of them: a (k, v) cache, run()'s variant
    parameters) that require grad."""
    needs = []
    for t in inputs:
        if isinstance(t, torch.Tensor):
            if t.requires_grad:
                needs.append(t)
        elif isinstance(t, (tuple, list, dict)):
            needs += _requiring_grad(tuple(t.values()) if isinstance(t, dict) else tuple(t))
    return needs


def guard(op: str | type, result: Any, *inputs: Any) -> Any:
    """``result`` (a tensor or a tuple of tensors) as it is, or, when grad mode is on and an input tensor requires
    grad (q, k, v, a learned sink or any tensor parameter: ``inputs`` may hold tuples and dicts of them), its
    tensors tied to those inputs by a backward that raises (see the module docstring). ``op``: the op's name, or a
    wrapper class (named with its run() only if the error is raised). Traceable by torch.compile (the compiled
    paths call it around their torch.ops.attnjit op, which registers no autograd kernel)."""
    if not torch.is_grad_enabled():
        return result
    needs = _requiring_grad(inputs)
    if not needs:
        return result
    outs = result if isinstance(result, tuple) else (result,)
    tied = _NoBackward.apply(op, len(outs), *outs, *needs)
    if not isinstance(result, tuple):
        return tied
    return tied if len(outs) > 1 else (tied,)


def refuse_in_place(op: str, *inputs: Any) -> None:
    """An in-place op (no output to tie a backward to) refuses inputs that require grad while grad mode is on: its
    write would be invisible to autograd."""
    if torch.is_grad_enabled() and _requiring_grad(inputs):
        raise RuntimeError(NO_BACKWARD.format(op=op) + f" ({op} writes in place: its inputs may not require grad)")


def grad_off() -> bool:
    """Turn grad mode off and return what it was, for ``set_grad(previous)`` in a ``finally``: the op bodies' form
    of ``torch.no_grad()``, whose context-manager frames cost about 1.5 us a call (issue 13's torch.ops budget)."""
    previous = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    return previous


set_grad = torch._C._set_grad_enabled
