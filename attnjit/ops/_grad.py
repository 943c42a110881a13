"""Autograd at the ops' boundary: attnjit's kernels have no backward pass, and saying so beats a silent zero.

An op called with grad mode on and an input that requires grad (q of a training step) returns its outputs with a
grad_fn whose backward raises, so ``loss.backward()`` through attention fails with the reason instead of leaving
q, k and v without gradients. Under ``torch.no_grad()`` / ``torch.inference_mode()``, or with inputs that do not
require grad (every serving engine), the outputs are returned as they are: the check reads grad mode and each
input's requires_grad (inside a (k, v) tuple or a dict of parameters too) and allocates nothing.

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
    so that a backward through them raises NO_BACKWARD. The raise is an op of its own (``attnjit::no_backward``,
    ops/library.py), not a Python ``raise`` here: torch.compile traces this backward with fake tensors when it
    compiles a graph whose inputs require grad, and ``fullgraph=True`` cannot trace a raise; the op's fake
    implementation gives a gradient's shape, its real one raises when the backward runs."""

    @staticmethod
    def forward(ctx, op: str, n_out: int, *tensors: torch.Tensor):
        ctx.op = op
        ctx.n_out = n_out
        # each input's shape, dtype and device for its gradient's fake shape, in one element (not the input itself,
        # which autograd keeps alive anyway only where it is a leaf, as for any op)
        ctx.save_for_backward(*(t.new_empty(()).expand(t.shape) for t in tensors[n_out:]))
        outs = tuple(t.detach() for t in tensors[:n_out])
        return outs if n_out > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(None for _ in range(ctx.n_out)),
                *(torch.ops.attnjit.no_backward(grads[0], like, ctx.op) for like in ctx.saved_tensors))


def _requiring(inputs):
    """The tensors among ``inputs`` (tensors, or tuples / lists / dicts of them) that require grad, lazily: the hot
    path's check (grad mode on, nothing requiring grad) walks them once and builds no list. None (an absent scale)
    is skipped first: it would otherwise cost three isinstance calls."""
    for t in inputs:
        if t is None:
            continue
        if isinstance(t, torch.Tensor):
            if t.requires_grad:
                yield t
        elif isinstance(t, (tuple, list, dict)) and t:   # (an empty dict of parameters: no call)
            yield from _requiring(t.values() if isinstance(t, dict) else t)


def _any_requiring_grad(inputs) -> bool:
    return next(_requiring(inputs), None) is not None


def _requiring_grad(inputs) -> list[torch.Tensor]:
    """Each tensor of _requiring(inputs) once (k passed as v too: torch.compile refuses an autograd.Function given
    one tensor twice)."""
    return list({id(t): t for t in _requiring(inputs)}.values())


def guard(op: str | type, result: Any, *inputs: Any) -> Any:
    """``result`` (a tensor or a tuple of tensors, Nones kept in place) as it is, or, when grad mode is on and an
    input tensor requires grad (q, k, v, a learned sink or any tensor parameter: ``inputs`` may hold tuples and dicts
    of them), its tensors tied to those inputs by a backward that raises (see the module docstring). ``op``: the
    op's name, or a wrapper class (named with its run()). Traceable by torch.compile, ``fullgraph=True`` included
    (the compiled paths call it around their torch.ops.attnjit op, which registers no autograd kernel)."""
    if not torch.is_grad_enabled():
        return result
    if not _any_requiring_grad(inputs):
        return result
    name = f"{op.__name__}.run()" if isinstance(op, type) else op
    outs = result if isinstance(result, tuple) else (result,)
    tensors = [o for o in outs if isinstance(o, torch.Tensor)]
    if not tensors:
        return result
    tied = _NoBackward.apply(name, len(tensors), *tensors, *_requiring_grad(inputs))
    if not isinstance(result, tuple):
        return tied
    it = iter(tied if len(tensors) > 1 else (tied,))
    return tuple(next(it) if isinstance(o, torch.Tensor) else o for o in outs)


def refuse_in_place(op: str, **inputs: Any) -> None:
    """An in-place op (no output to tie a backward to) refuses inputs that require grad while grad mode is on: its
    write would be invisible to autograd. ``inputs`` by argument name, the first that requires grad named."""
    if torch.is_grad_enabled() and _any_requiring_grad(inputs.values()):
        name = next(n for n, t in inputs.items() if _any_requiring_grad((t,)))
        raise RuntimeError(NO_BACKWARD.format(op=op) + f" ({op} writes in place: its inputs may not require grad; "
                           f"{name} does)")


def grad_off() -> bool:
    """Turn grad mode off and return what it was, for ``set_grad(previous)`` in a ``finally``: the op bodies' form
    of ``torch.no_grad()``, whose context-manager frames cost about 1.5 us a call (issue 13's torch.ops budget)."""
    previous = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    return previous


set_grad = torch._C._set_grad_enabled
