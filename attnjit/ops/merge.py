"""merge_state, merge_state_in_place, merge_states: combine attention states over disjoint key sets (base-2 lse).

The kernels take every tensor's strides, so any view is read right, with two rules: v tensors move 16 bytes at a
time (16-byte aligned start and token/state/head strides), and a tensor written in place has distinct elements.
Inside torch.compile each call is its torch.ops.attnjit op (ops/library.py); the *_eager functions are the bodies."""

from __future__ import annotations

import torch

from .. import dispatch
from ..generator import PARAMS
from ._common import (SPEC_DTYPE, check_head_dim, check_no_overlap, check_tensor, check_vectors, require_cuda,
                      spec_for)

_BLOCK = 128
_launches: dict[tuple, dispatch.Launch] = {}


def _launch(v: torch.Tensor, kernel: str, rows_heads: int, values: list) -> None:
    spec = spec_for(op="merge_state", head_dim=v.shape[-1], dtype=SPEC_DTYPE[v.dtype],
                    arch=dispatch.device_arch(v.device))
    mod = dispatch.module(spec, v.device)
    memo = (mod.key, mod.device_index, kernel)
    launch = _launches.get(memo)
    if launch is None:
        launch = dispatch.Launch("merge_state", mod.kernels[kernel], (1, 1, 1))
        _launches[memo] = launch
    threads = rows_heads * (v.shape[-1] // 8)
    launch.grid = (-(-threads // _BLOCK), 1, 1)
    launch(values)


def _check_v(name: str, v, dim: int, device=None) -> torch.Tensor:
    check_tensor(name, v, dtype=(torch.float16, torch.bfloat16), dim=dim, device=device)
    check_head_dim(f"{name}.shape[-1] (head_dim)", v.shape[-1])
    if v.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {v.stride()}")
    check_vectors(name, v, tuple(range(dim - 1)))
    return v


def _check_pair(names: tuple[str, str, str, str], v_a, s_a, v_b, s_b) -> None:
    """Two states (v [seq, H, D] fp16/bf16, s [seq, H] float32) of one shape, dtype and device."""
    _check_v(names[0], v_a, 3)
    dev = v_a.device
    _check_v(names[2], v_b, 3, dev)
    if v_b.shape != v_a.shape or v_b.dtype != v_a.dtype:
        raise ValueError(f"{names[2]} must match {names[0]} ({v_a.dtype} {list(v_a.shape)}), got {v_b.dtype} "
                         f"{list(v_b.shape)}")
    for name, s in ((names[1], s_a), (names[3], s_b)):
        check_tensor(name, s, dtype=torch.float32, dim=2, device=dev)
        if tuple(s.shape) != tuple(v_a.shape[:2]):
            raise ValueError(f"{name} must be [seq, H] = {list(v_a.shape[:2])}, got {list(s.shape)}")


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v_a/v_b: [seq, H, D] (fp16/bf16), s_a/s_b: [seq, H] float32 base-2 lse -> (v [seq, H, D], s [seq, H])."""
    if torch.compiler.is_compiling():
        return tuple(torch.ops.attnjit.merge_state(v_a, s_a, v_b, s_b))
    return merge_state_eager(v_a, s_a, v_b, s_b)


def merge_state_eager(v_a, s_a, v_b, s_b) -> tuple[torch.Tensor, torch.Tensor]:
    _check_pair(("v_a", "s_a", "v_b", "s_b"), v_a, s_a, v_b, s_b)
    require_cuda("merge_state", "v_a", v_a)
    v = torch.empty_like(v_a, memory_format=torch.contiguous_format)
    s = torch.empty(v_a.shape[:2], dtype=torch.float32, device=v_a.device)
    _merge_two(v_a, s_a, v_b, s_b, v, s, None)
    return v, s


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask: torch.Tensor | None = None) -> None:
    """(v, s) <- merge((v, s), (v_other, s_other)) for rows where mask (bool [seq], default all) is true."""
    if torch.compiler.is_compiling():
        torch.ops.attnjit.merge_state_in_place(v, s, v_other, s_other, mask)
        return
    merge_state_in_place_eager(v, s, v_other, s_other, mask)


def merge_state_in_place_eager(v, s, v_other, s_other, mask=None) -> None:
    _check_pair(("v", "s", "v_other", "s_other"), v, s, v_other, s_other)
    if mask is not None:
        check_tensor("mask", mask, dtype=torch.bool, dim=1, device=v.device)
        if mask.shape[0] != v.shape[0] or not mask.is_contiguous():
            raise ValueError(f"mask must be a contiguous bool [seq={v.shape[0]}] tensor (the kernel reads it as a "
                             f"dense array), got shape {list(mask.shape)} strides {mask.stride()}")
    check_no_overlap("v", v)
    check_no_overlap("s", s)
    require_cuda("merge_state_in_place", "v", v)
    _merge_two(v, s, v_other, s_other, v, s, mask)


def _merge_two(v_a, s_a, v_b, s_b, v_out, s_out, mask) -> None:
    rows, heads = v_a.shape[0], v_a.shape[1]
    if rows * heads == 0:
        return
    values = PARAMS["merge_two"].values(
        v_a=v_a.data_ptr(), lse_a=s_a.data_ptr(), v_b=v_b.data_ptr(), lse_b=s_b.data_ptr(), v_out=v_out.data_ptr(),
        lse_out=s_out.data_ptr(), mask=mask.data_ptr() if mask is not None else 0, num_rows=rows, num_heads=heads,
        v_a_stride_n=v_a.stride(0), v_a_stride_h=v_a.stride(1), v_b_stride_n=v_b.stride(0), v_b_stride_h=v_b.stride(1),
        v_out_stride_n=v_out.stride(0), v_out_stride_h=v_out.stride(1), lse_a_stride_n=s_a.stride(0),
        lse_a_stride_h=s_a.stride(1), lse_b_stride_n=s_b.stride(0), lse_b_stride_h=s_b.stride(1),
        lse_out_stride_n=s_out.stride(0), lse_out_stride_h=s_out.stride(1))
    _launch(v_a, "attnjit_merge_state", rows * heads, values)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v: [seq, num_states, H, D], s: [seq, num_states, H] float32 -> (v [seq, H, D], s [seq, H])."""
    if torch.compiler.is_compiling():
        return tuple(torch.ops.attnjit.merge_states(v, s))
    return merge_states_eager(v, s)


def merge_states_eager(v, s) -> tuple[torch.Tensor, torch.Tensor]:
    _check_v("v", v, 4)
    check_tensor("s", s, dtype=torch.float32, dim=3, device=v.device)
    if tuple(s.shape) != tuple(v.shape[:3]):
        raise ValueError(f"s must be [seq, num_states, H] = {list(v.shape[:3])}, got {list(s.shape)}")
    require_cuda("merge_states", "v", v)
    rows, states, heads, dim = v.shape
    out = torch.empty((rows, heads, dim), dtype=v.dtype, device=v.device)
    lse = torch.empty((rows, heads), dtype=torch.float32, device=v.device)
    if rows * heads == 0:
        return out, lse
    values = PARAMS["merge_many"].values(
        v=v.data_ptr(), lse=s.data_ptr(), v_out=out.data_ptr(), lse_out=lse.data_ptr(), num_rows=rows,
        num_states=states, num_heads=heads, v_stride_n=v.stride(0), v_stride_s=v.stride(1), v_stride_h=v.stride(2),
        lse_stride_n=s.stride(0), lse_stride_s=s.stride(1), lse_stride_h=s.stride(2), v_out_stride_n=out.stride(0),
        v_out_stride_h=out.stride(1), lse_out_stride_n=lse.stride(0), lse_out_stride_h=lse.stride(1))
    _launch(v, "attnjit_merge_states", rows * heads, values)
    return out, lse
