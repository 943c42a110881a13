"""attnjit's ops as torch.library ops (``torch.ops.attnjit.*``), with fake implementations, for torch.compile.

Each public op (single_prefill_with_kv_cache, single_decode_with_kv_cache, the wrappers' run(), merge_state,
merge_state_in_place, merge_states, append_paged_kv_cache) calls its torch.ops.attnjit op while torch.compile traces
(``torch.compiler.is_compiling()``) and runs directly otherwise, so eager calls pay nothing for the registration. The
ops are opaque to the compiler: the fake implementations give output shapes and dtypes, the real ones are the eager
code, which checks every argument as it always does.

- ``batch_run`` / ``batch_run_out`` run a wrapper's current plan (their body is the wrapper's run(), which is the
  eager code when not tracing); the wrapper is named by an integer handle (see _handles), and plan() stays outside
  the compiled region (it is host code that reads metadata). Under
  mode="reduce-overhead" (CUDA graphs) use a use_cuda_graph=True wrapper so that later plans (plan() or
  fast_plan()) keep the addresses the captured graph reads, exactly as with a hand-captured graph.
- ``single_prefill`` / ``single_decode`` plan and run one request. A plan is cached per shape and options (one per
  device, up to 64), so the calls a CUDA graph captures only launch; a shape first seen while a graph is being
  captured is an error that says to run it once outside capture (torch.compile's reduce-overhead mode does).

``no_backward`` is not an op of the API: it is the backward of the outputs that ops/_grad.py ties to inputs requiring
grad (it raises; its fake implementation lets torch.compile trace that backward).

Defined with torch.library.Library (``define`` + ``impl`` per device) rather than ``custom_op``: the dispatcher adds
about 1.6 us over a direct call that way, ``custom_op`` about 7.6 us (measured on the CI CPU with a no-op body).
Run-time variant parameters are not supported through these ops (bind variants at plan() instead).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _handles
from ._grad import NO_BACKWARD, grad_off, set_grad
# the merge ops' bodies are the eager functions themselves (no wrapper frame, no import per call: the op's cost over
# a direct call is the dispatcher's alone, issue 13's "within 2 us")
from .merge import merge_state_eager, merge_state_in_place_eager, merge_states_eager

LIB = torch.library.Library("attnjit", "DEF")

SCHEMAS = {
    "batch_run": "batch_run(int handle, Tensor q, Tensor k, Tensor? v, bool want_lse, float? k_scale=None, "
                 "float? v_scale=None, Tensor? k_scale_t=None, Tensor? v_scale_t=None) -> (Tensor, Tensor)",
    "batch_run_out": "batch_run_out(int handle, Tensor q, Tensor k, Tensor? v, Tensor(a!) out, Tensor(b!)? lse, "
                     "float? k_scale=None, float? v_scale=None, Tensor? k_scale_t=None, Tensor? v_scale_t=None) -> ()",
    "single_prefill": "single_prefill(Tensor q, Tensor k, Tensor v, bool causal, str kv_layout, float? sm_scale, "
                      "int window_left, float? logits_soft_cap, str pos_encoding_mode, bool want_lse) "
                      "-> (Tensor, Tensor)",
    "single_decode": "single_decode(Tensor q, Tensor k, Tensor v, str kv_layout, float? sm_scale, int window_left, "
                     "float? logits_soft_cap, str pos_encoding_mode, bool want_lse) -> (Tensor, Tensor)",
    "merge_state": "merge_state(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b) -> (Tensor, Tensor)",
    "merge_state_in_place": "merge_state_in_place(Tensor(a!) v, Tensor(b!) s, Tensor v_other, Tensor s_other, "
                            "Tensor? mask) -> ()",
    "merge_states": "merge_states(Tensor v, Tensor s) -> (Tensor, Tensor)",
    "no_backward": "no_backward(Tensor grad, Tensor like, str op) -> Tensor",
    "append_paged_kv_cache": "append_paged_kv_cache(Tensor append_key, Tensor append_value, Tensor batch_indices, "
                             "Tensor positions, Tensor(a!) k_cache, Tensor(b!)? v_cache, Tensor kv_indices, "
                             "Tensor kv_indptr, Tensor kv_last_page_len, str kv_layout, bool check) -> ()",
}


def _no_lse(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


def _cache(k: Tensor, v: Tensor | None):
    return k if v is None else (k, v)


# --- real implementations: the eager code ----------------------------------------------------------------------

def _run(handle: int, q: Tensor, k: Tensor, v: Tensor | None, scales: tuple, **kwargs):
    """The wrapper's eager run() on the op's arguments (ragged: k and v; paged: the cache)."""
    w = _handles.lookup(handle)
    k_scale, v_scale, k_scale_t, v_scale_t = scales
    kwargs.update(k_scale=k_scale_t if k_scale_t is not None else k_scale,
                  v_scale=v_scale_t if v_scale_t is not None else v_scale)
    grad = grad_off()   # below the dispatcher's autograd: no guard (ops/_grad.py) inside an op body
    try:
        return w.run(q, k, v, **kwargs) if w._op_kind == "ragged" else w.run(q, _cache(k, v), **kwargs)
    finally:
        set_grad(grad)
        # an op body keeps no reference to its inputs: under mode="reduce-overhead" a KV cache that is not a static
        # address is a copy in the CUDA-graph pool while the graph records, and run()'s memo of the last cache
        # would keep that copy alive ("tensor(s) in the cudagraph pool not tracked as outputs")
        w._cache_memo = None


def _batch_run(handle: int, q: Tensor, k: Tensor, v: Tensor | None, want_lse: bool, k_scale=None, v_scale=None,
               k_scale_t=None, v_scale_t=None):
    result = _run(handle, q, k, v, (k_scale, v_scale, k_scale_t, v_scale_t), return_lse=want_lse)
    return result if want_lse else (result, _no_lse(q))


def _batch_run_out(handle: int, q: Tensor, k: Tensor, v: Tensor | None, out: Tensor, lse: Tensor | None,
                   k_scale=None, v_scale=None, k_scale_t=None, v_scale_t=None) -> None:
    _run(handle, q, k, v, (k_scale, v_scale, k_scale_t, v_scale_t), out=out, lse=lse, return_lse=lse is not None)


def _single_prefill(q, k, v, causal, kv_layout, sm_scale, window_left, logits_soft_cap, pos_encoding_mode, want_lse):
    from .single import single_prefill_eager

    grad = grad_off()   # below the dispatcher's autograd: no guard (ops/_grad.py) inside an op body
    try:
        o, lse = single_prefill_eager(q, k, v, causal=causal, kv_layout=kv_layout, sm_scale=sm_scale,
                                      window_left=window_left, logits_soft_cap=logits_soft_cap,
                                      pos_encoding_mode=pos_encoding_mode, return_lse=True, cached=True)
    finally:
        set_grad(grad)
    return o, (lse if want_lse else _no_lse(q))


def _single_decode(q, k, v, kv_layout, sm_scale, window_left, logits_soft_cap, pos_encoding_mode, want_lse):
    o, lse = _single_prefill(q.unsqueeze(0), k, v, False, kv_layout, sm_scale, window_left, logits_soft_cap,
                             pos_encoding_mode, True)
    return o[0], (lse[0] if want_lse else _no_lse(q))


def _append(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
            kv_last_page_len, kv_layout, check) -> None:
    from .page import append_paged_kv_cache_eager

    append_paged_kv_cache_eager(append_key, append_value, batch_indices, positions, _cache(k_cache, v_cache),
                                kv_indices, kv_indptr, kv_last_page_len, kv_layout, check=check)


def _no_backward(grad, like, op):
    """The backward of an attnjit op's outputs (ops/_grad.py): raises, as an op so that torch.compile can trace it."""
    raise RuntimeError(NO_BACKWARD.format(op=op))


# --- fake implementations: shapes and dtypes -----------------------------------------------------------------

def _fake_batch_run(handle, q, k, v, want_lse, *scales):
    plan = _handles.lookup(handle)._plan
    if plan is None:
        raise RuntimeError("torch.ops.attnjit.batch_run: the wrapper has no plan; call plan() before the compiled "
                           "code runs")
    out = q.new_empty(q.shape, dtype=plan.o_dtype)
    return out, (q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32) if want_lse else _no_lse(q))


def _fake_single(q, k, v, *rest):
    want_lse = rest[-1]
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        (q.new_empty(q.shape[:-1], dtype=torch.float32) if want_lse else _no_lse(q))


def _fake_merge_state(v_a, s_a, v_b, s_b):
    return torch.empty_like(v_a, memory_format=torch.contiguous_format), \
        v_a.new_empty(v_a.shape[:2], dtype=torch.float32)


def _fake_merge_states(v, s):
    rows, _, heads, dim = v.shape
    return v.new_empty((rows, heads, dim)), v.new_empty((rows, heads), dtype=torch.float32)


def _fake_none(*args) -> None:
    return None


def _fake_no_backward(grad, like, op):
    return torch.empty_like(like, memory_format=torch.contiguous_format)


_IMPLS = {"batch_run": (_batch_run, _fake_batch_run), "batch_run_out": (_batch_run_out, _fake_none),
          "single_prefill": (_single_prefill, _fake_single), "single_decode": (_single_decode, _fake_single),
          "merge_state": (merge_state_eager, _fake_merge_state),
          "merge_state_in_place": (merge_state_in_place_eager, _fake_none),
          "merge_states": (merge_states_eager, _fake_merge_states), "append_paged_kv_cache": (_append, _fake_none),
          "no_backward": (_no_backward, _fake_no_backward)}

for _name, _schema in SCHEMAS.items():
    LIB.define(_schema)
    _real, _fake = _IMPLS[_name]
    for _key in ("CUDA", "CPU"):   # on the CPU the eager code raises attnjit's NoGPUError after its checks
        LIB.impl(_name, _real, _key)
    torch.library.register_fake(f"attnjit::{_name}", _fake, lib=LIB)


def ops() -> list[str]:
    """The registered op names (torch.ops.attnjit.<name>)."""
    return list(SCHEMAS)
