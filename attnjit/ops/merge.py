"""merge_state, merge_state_in_place, merge_states: combine attention states over disjoint key sets (base-2 lse).

The kernels take every tensor's strides, so any view is read right, with two rules: v tensors move 16 bytes at a
time (16-byte aligned start and token/state/head strides), and a tensor written in place has distinct elements.
Inside torch.compile each call is its torch.ops.attnjit op (ops/library.py); the *_eager functions are the bodies."""

from __future__ import annotations

import torch

from .. import dispatch
from ..generator import PARAMS
from ..specs import HEAD_DIMS
from ._common import (COMPUTE_DTYPES, SPEC_DTYPE, byte_span, check_head_dim, check_no_overlap, check_tensor,
                      check_vectors, require_cuda, spec_for)
from ._grad import guard, refuse_in_place

_BLOCK = 128
_launches = dispatch.module_memo()  # (dtype, head_dim, device index) -> {kernel name: Launch}: per call one lookup


def _launch(v: torch.Tensor, kernel: str, rows_heads: int, values: list) -> None:
    key = (v.dtype, v.shape[-1], v.get_device())
    launches = _launches.get(key)
    if launches is None:
        spec = spec_for(op="merge_state", head_dim=v.shape[-1], dtype=SPEC_DTYPE[v.dtype],
                        arch=dispatch.device_arch(v.device))
        mod = dispatch.module(spec, v.device)
        launches = _launches[key] = {name: dispatch.Launch("merge_state", k, (1, 1, 1))
                                     for name, k in mod.kernels.items()}
    launch = launches[kernel]
    threads = rows_heads * (v.shape[-1] // 8)
    launch.grid = (-(-threads // _BLOCK), 1, 1)
    launch(values)


def _v_ready(v, dim: int, device) -> bool:
    """The common case of _check_v in one test: fp16/bf16, ``dim``-D, on ``device``, a supported head dim, the last
    dim contiguous, 16-byte aligned with 16-byte strides (8 elements) along the other dims."""
    if type(v) is not torch.Tensor or v.dtype not in COMPUTE_DTYPES or v.dim() != dim \
            or (device is not None and v.device != device):
        return False
    shape, stride = v.shape, v.stride()
    return (shape[-1] in HEAD_DIMS and stride[-1] == 1 and v.data_ptr() % 16 == 0
            and all(shape[i] <= 1 or stride[i] % 8 == 0 for i in range(dim - 1)))


def _check_v(name: str, v, dim: int, device=None) -> torch.Tensor:
    if _v_ready(v, dim, device):
        return v
    check_tensor(name, v, dtype=COMPUTE_DTYPES, dim=dim, device=device)
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
    rows_heads = v_a.shape[:2]
    for name, s in ((names[1], s_a), (names[3], s_b)):
        if type(s) is torch.Tensor and s.dtype is torch.float32 and s.shape == rows_heads and s.device == dev:
            continue  # the common case (a 2-D shape equal to [seq, H]), without building the messages
        check_tensor(name, s, dtype=torch.float32, dim=2, device=dev)
        if tuple(s.shape) != tuple(rows_heads):
            raise ValueError(f"{name} must be [seq, H] = {list(rows_heads)}, got {list(s.shape)}")


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v_a/v_b: [seq, H, D] (fp16/bf16), s_a/s_b: [seq, H] float32 base-2 lse -> (v [seq, H, D], s [seq, H])."""
    result = tuple(torch.ops.attnjit.merge_state(v_a, s_a, v_b, s_b)) if torch.compiler.is_compiling() \
        else merge_state_eager(v_a, s_a, v_b, s_b)
    return guard("merge_state", result, v_a, s_a, v_b, s_b)


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
    refuse_in_place("merge_state_in_place", v=v, s=s, v_other=v_other, s_other=s_other)
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
    _check_in_place_apart(v, s, v_other, s_other, mask)
    require_cuda("merge_state_in_place", "v", v)
    _merge_two(v, s, v_other, s_other, v, s, mask)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()


def _may_share(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose byte spans overlap may share an element. Exact for two views of one shape, dtype and
    strides whose strides nest (each larger than the reach of the smaller ones: the views of a dense table, such as
    the states of [rows, states, heads, D] taken one state apart): then b's start lies at a + sum k_i stride_i with
    |k_i| < shape_i exactly when some element is shared, and each k_i has at most two candidates. Otherwise True."""
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return True
    delta, rem = divmod(b.data_ptr() - a.data_ptr(), a.element_size())
    if rem:
        return True
    dims = sorted(((st, n) for st, n in zip(a.stride(), a.shape) if n > 1), reverse=True)
    reach = 0
    for st, n in reversed(dims):   # each stride beyond what the smaller ones reach
        if st <= reach:
            return True
        reach += st * (n - 1)

    def fits(d: int, i: int) -> bool:
        if i == len(dims):
            return d == 0
        st, n = dims[i]
        return any(abs(k) < n and fits(d - k * st, i + 1) for k in {d // st, -(-d // st)})

    return fits(delta, 0)


def _check_in_place_apart(v, s, v_other, s_other, mask) -> None:
    """merge_state_in_place writes v and s while it reads v_other, s_other and mask, each element by the thread that
    reads the same row: v and s share no byte; v_other (s_other) is v (s) itself or shares no element with v and s
    (interleaved views of one table are told apart: _may_share); the mask shares none. Anything else (v_other one
    row off v, s over v's bytes, a mask inside s) is a race whose result depends on timing."""
    written = (("v", byte_span(v)), ("s", byte_span(s)))
    (_, (vlo, vhi)), (_, (slo, shi)) = written
    if vlo < shi and slo < vhi:
        raise ValueError(f"merge_state_in_place: v and s share memory (bytes {vlo:#x}..{vhi:#x} and "
                         f"{slo:#x}..{shi:#x}); the kernel writes both: give each memory of its own")
    for name, t, own in (("v_other", v_other, v), ("s_other", s_other, s), ("mask", mask, None)):
        if t is None or (own is not None and _same_view(t, own)):
            continue
        lo, hi = byte_span(t)
        for (wname, (wlo, whi)), w in zip(written, (v, s)):
            if lo < whi and wlo < hi and _may_share(t, w):
                raise ValueError(f"merge_state_in_place: {name} shares memory with {wname} (bytes {lo:#x}..{hi:#x} "
                                 f"and {wlo:#x}..{whi:#x}) without being it; the kernel writes {wname} while it reads "
                                 f"{name}: pass {name} in memory of its own (or {wname} itself)")


def _merge_two(v_a, s_a, v_b, s_b, v_out, s_out, mask) -> None:
    rows, heads = v_a.shape[0], v_a.shape[1]
    if rows * heads == 0:
        return
    va, vb, vo, sa, sb, so = v_a.stride(), v_b.stride(), v_out.stride(), s_a.stride(), s_b.stride(), s_out.stride()
    values = [v_a.data_ptr(), s_a.data_ptr(), v_b.data_ptr(), s_b.data_ptr(), v_out.data_ptr(), s_out.data_ptr(),
              mask.data_ptr() if mask is not None else 0, rows, heads, va[0], va[1], vb[0], vb[1], vo[0], vo[1],
              sa[0], sa[1], sb[0], sb[1], so[0], so[1]]  # PARAMS["merge_two"]'s order (asserted below)
    _launch(v_a, "attnjit_merge_state", rows * heads, values)


assert PARAMS["merge_two"].names == (
    "v_a", "lse_a", "v_b", "lse_b", "v_out", "lse_out", "mask", "num_rows", "num_heads", "v_a_stride_n",
    "v_a_stride_h", "v_b_stride_n", "v_b_stride_h", "v_out_stride_n", "v_out_stride_h", "lse_a_stride_n",
    "lse_a_stride_h", "lse_b_stride_n", "lse_b_stride_h", "lse_out_stride_n", "lse_out_stride_h")
assert PARAMS["merge_many"].names == (
    "v", "lse", "v_out", "lse_out", "num_rows", "num_states", "num_heads", "v_stride_n", "v_stride_s", "v_stride_h",
    "lse_stride_n", "lse_stride_s", "lse_stride_h", "v_out_stride_n", "v_out_stride_h", "lse_out_stride_n",
    "lse_out_stride_h")


def merge_partials_in_place(v: torch.Tensor, s: torch.Tensor, tmp_o: int, tmp_lse: int, table: torch.Tensor,
                            scale: float = 1.0) -> None:
    """(v, s) <- merge((v, s), the fp32 partial states of a deferred-merge plan), per row (the wrappers' run() of
    such a plan; scheduler.defer_merges). v: [rows, H, D] fp16/bf16 and s: [rows, H] float32 as run() checked them
    (out, lse), tmp_o / tmp_lse the workspace's partial states, table the plan's int32 [rows, 3] on v's device;
    each partial's o times ``scale`` (run()'s float v_scale of a 16-bit plan) first."""
    rows, heads = v.shape[0], v.shape[1]
    if rows * heads == 0:
        return
    if tuple(table.shape) != (rows, 3) or table.dtype is not torch.int32 or not table.is_contiguous():
        raise ValueError(f"merge table must be int32 [{rows}, 3], contiguous; got {table.dtype} {list(table.shape)}")
    vs, ss = v.stride(), s.stride()
    values = [v.data_ptr(), s.data_ptr(), tmp_o, tmp_lse, table.data_ptr(), rows, heads, vs[0], vs[1], ss[0], ss[1],
              float(scale)]  # PARAMS["merge_partials"]'s order (asserted below)
    _launch(v, "attnjit_merge_partials", rows * heads, values)


assert PARAMS["merge_partials"].names == (
    "v", "lse", "tmp_o", "tmp_lse", "table", "num_rows", "num_heads", "v_stride_n", "v_stride_h", "lse_stride_n",
    "lse_stride_h", "partial_scale")


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v: [seq, num_states, H, D], s: [seq, num_states, H] float32 -> (v [seq, H, D], s [seq, H])."""
    result = tuple(torch.ops.attnjit.merge_states(v, s)) if torch.compiler.is_compiling() else merge_states_eager(v, s)
    return guard("merge_states", result, v, s)


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
    vs, ss = v.stride(), s.stride()
    values = [v.data_ptr(), s.data_ptr(), out.data_ptr(), lse.data_ptr(), rows, states, heads, vs[0], vs[1], vs[2],
              ss[0], ss[1], ss[2], heads * dim, dim, heads, 1]  # PARAMS["merge_many"]'s order; out, lse dense
    _launch(v, "attnjit_merge_states", rows * heads, values)
    return out, lse
