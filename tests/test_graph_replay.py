"""Graph mode (use_cuda_graph=True) on the CPU: a re-plan must fit what a captured run() replays (ops/_graph.py).

A replay launches the captured kernel with the captured parameter struct over the work list the fixed buffers hold
by then. So a later plan() with more query rows than the captured q and out (or more KV rows than a captured ragged
k and v) would make the replay read and write past them, and one that changes a value the struct carries (sm_scale,
a variant's value, a mask tensor) would be silently ignored by the replay. Each is refused before plan() writes
anything, and the refused plan leaves the last one in place. A CPU wrapper runs every run() check and notes the
operands before it stops with NoGPUError; a capture is simulated by the metadata buffers' ``capturing``."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import attnjit
from attnjit.errors import NoGPUError
from attnjit.ops._graph import Replay
from tests.helpers import i32

H, D, PS = 8, 128, 4
F16 = torch.float16


def _ws(mib: int = 64) -> torch.Tensor:
    return torch.empty(mib << 20, dtype=torch.uint8)


def _paged(rows_per_request: int, **opts):
    """A graph-mode paged prefill wrapper planned for 2 requests of 2 pages each, and its plan's arguments."""
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(_ws(), use_cuda_graph=True)
    return w, _plan_paged(w, rows_per_request, **opts)


def _plan_paged(w, rows_per_request: int, **opts):
    n = rows_per_request
    w.plan(i32([0, n, 2 * n]), i32([0, 2, 4]), i32([0, 1, 2, 3]), i32([PS, PS]), H, H, D, PS, q_data_type=F16,
           **opts)
    return n


def _run(w, rows: int, pages: int = 4, capture: bool = False):
    """run() as a capture (``capture``) or a warm-up would call it; on the CPU it stops after its checks."""
    q = torch.zeros(rows, H, D, dtype=F16)
    with _capturing(w, capture), pytest.raises(NoGPUError):
        w.run(q, torch.zeros(pages, 2, PS, H, D, dtype=F16))


@contextlib.contextmanager
def _capturing(w, on: bool = True):
    """The stream captures a graph while inside (the metadata buffers' ``capturing``, which a CPU one never is)."""
    w._meta.capturing = lambda: on
    try:
        yield
    finally:
        del w._meta.capturing


def test_the_replay_bounds_rows_by_the_captured_runs_and_pages_by_the_last_run_before_one():
    r = Replay()
    r.note_run(False, 8, 16, paged=True)          # warm-up: no graph yet, so no row bound; the cache's pages count
    r.check_batch(1000, 0, 15, paged=True)
    with pytest.raises(ValueError, match="page id 16 .* last run.* 16 pages"):
        r.check_batch(8, 0, 16, paged=True)
    r.note_run(True, 6, 12, paged=True)           # a capture: what every replay reads
    r.note_run(True, 9, 30, paged=True)           # a second run in a capture: the smaller of each bound
    r.note_run(False, 100, 1000, paged=True)      # a later eager run does not loosen them
    with pytest.raises(ValueError, match="7 query rows.*captured run"):
        r.check_batch(7, 0, 0, paged=True)
    with pytest.raises(ValueError, match="page id 12 .* captured run.* 12 pages"):
        r.check_batch(6, 0, 12, paged=True)
    r.check_batch(6, 0, 11, paged=True)
    g = Replay()
    g.note_run(True, 20, 64, paged=False)         # ragged: k's and v's rows
    with pytest.raises(ValueError, match="65 KV rows"):
        g.check_batch(20, 65, -1, paged=False)
    g.check_batch(20, 64, -1, paged=False)


def test_before_a_capture_a_wrapper_may_grow():
    """An engine warms up on a small batch, then plans its largest and captures: no graph exists to protect yet."""
    w, _ = _paged(1)
    _run(w, 2)
    _plan_paged(w, 4)
    _run(w, 8, capture=True)
    with pytest.raises(ValueError, match="10 query rows"):
        _plan_paged(w, 5)


def test_a_replan_with_more_query_rows_than_the_captured_q_is_refused_and_changes_nothing():
    w, n = _paged(4)
    _run(w, 2 * n, capture=True)
    before = w._plan
    with pytest.raises(ValueError, match="16 query rows but q and out of the captured run"):
        _plan_paged(w, 8)
    assert w._plan is before
    _plan_paged(w, 3)                                   # fewer rows: the replay reads and writes a prefix of them
    assert w._plan.total_q == 6
    _run(w, 6)                                          # an eager run after the capture does not move the bound
    with pytest.raises(ValueError, match="10 query rows"):
        _plan_paged(w, 5)


def test_a_replan_with_more_ragged_kv_rows_than_the_captured_k_is_refused():
    w = attnjit.BatchPrefillWithRaggedKVCacheWrapper(_ws(), use_cuda_graph=True)
    w.plan(i32([0, 2, 4]), i32([0, 8, 16]), H, H, D, causal=True, q_data_type=F16)
    k = torch.zeros(16, H, D, dtype=F16)
    with _capturing(w), pytest.raises(NoGPUError):
        w.run(torch.zeros(4, H, D, dtype=F16), k, k.clone())
    with pytest.raises(ValueError, match="10000 KV rows but k and v of the captured run"):
        w.plan(i32([0, 2, 4]), i32([0, 5000, 10000]), H, H, D, causal=True, q_data_type=F16)
    w.plan(i32([0, 1, 2]), i32([0, 3, 9]), H, H, D, causal=True, q_data_type=F16)


@pytest.mark.parametrize("first,second", [
    ({}, {"sm_scale": 0.25}),
    ({"logits_soft_cap": 30.0}, {"logits_soft_cap": 50.0}),
    ({"window_left": 3}, {"window_left": 5}),
], ids=["sm_scale", "soft_cap", "window"])
def test_a_replan_that_changes_a_value_the_replay_carries_is_refused(first, second):
    w, n = _paged(2, **first)
    _plan_paged(w, 2, **first)        # the same values: a re-plan
    before = w._plan
    with pytest.raises(ValueError, match="kernel parameter .* a replay passes the captured parameters"):
        _plan_paged(w, 2, **second)
    assert w._plan is before


def test_a_rope_replan_keeps_its_table_however_many_configurations_the_process_saw():
    """ROPE_LLAMA's frequency table is a tensor the struct points at, memoized per configuration: a graph-mode
    re-plan must find the same tensor even after the process has made tables for 100 other configurations (the memo
    used to be cleared past 64, handing the re-plan a new tensor, which the graph check refuses)."""
    opts = dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=1.0, rope_theta=1e4)
    w, n = _paged(2, **opts)
    eager = attnjit.BatchPrefillWithPagedKVCacheWrapper(_ws(16))
    for theta in range(100):
        eager.plan(i32([0, 1, 2]), i32([0, 2, 4]), i32([0, 1, 2, 3]), i32([PS, PS]), H, H, D, PS, q_data_type=F16,
                   pos_encoding_mode="ROPE_LLAMA", rope_theta=2e4 + theta)
    before = w._plan
    _plan_paged(w, 2, **opts)
    assert w._plan is not before and w._plan.plan_values == before.plan_values


def test_a_custom_mask_is_refused_under_a_graph():
    """The mask is a tensor the struct points at, made anew by each plan: a replay would read the captured plan's
    (freed once a new plan replaces it), never the new one."""
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(_ws(), use_cuda_graph=True)
    args = (i32([0, 1, 2]), i32([0, 2, 4]), i32([0, 1, 2, 3]), i32([PS, PS]), H, H, D, PS)
    with pytest.raises(NotImplementedError, match="custom_mask.*use_cuda_graph"):
        w.plan(*args, custom_mask=torch.ones(16, dtype=torch.bool), q_data_type=F16)
    with pytest.raises(NotImplementedError, match="custom_mask.*use_cuda_graph"):
        w.plan(*args, packed_custom_mask=torch.full((4,), 255, dtype=torch.uint8), q_data_type=F16)
    attnjit.BatchPrefillWithPagedKVCacheWrapper(_ws()).plan(*args, custom_mask=torch.ones(16, dtype=torch.bool),
                                                            q_data_type=F16)


def test_a_cascade_captured_side_by_side_keeps_its_last_level_unsplit():
    """Level 0 runs beside the last level under a capture only where the last level is unsplit (the two then share
    no workspace). A later plan whose last level would split keeps it unsplit: the captured graph still runs the two
    side by side, and two levels' partial states at one workspace address would race."""
    w = attnjit.MultiLevelCascadeAttentionWrapper(2, _ws(), use_cuda_graph=True)
    hq, b, prefix = 32, 4, 64

    def plan(suffix_pages: int, **opts):
        qo1 = i32(list(range(b + 1)))
        kv1 = i32([i * suffix_pages for i in range(b + 1)])
        idx1 = i32([prefix + j for j in range(b * suffix_pages)])
        w.plan([i32([0, b]), qo1], [i32([0, prefix]), kv1], [i32(list(range(prefix))), idx1],
               [i32([16]), i32([16] * b)], hq, 8, D, 16, causal=True, q_data_type=F16, **opts)
        return w._batch_prefill_wrappers

    l0, last = plan(1)
    assert l0._share_gpu and last._plan.work.chunk is None
    for split in ({}, {"fixed_split_size": 256}):   # a fixed split size would split it too
        l0, last = plan(2000, **split)
        assert l0._share_gpu and last._plan.work.chunk is None, "the last level split under a side-by-side graph"
    eager = attnjit.MultiLevelCascadeAttentionWrapper(2, _ws())   # without a graph the long suffix splits
    eager.plan([i32([0, b]), i32(list(range(b + 1)))], [i32([0, prefix]), i32([i * 2000 for i in range(b + 1)])],
               [i32(list(range(prefix))), i32([prefix + j for j in range(b * 2000)])], [i32([16]), i32([16] * b)],
               hq, 8, D, 16, causal=True, q_data_type=F16)
    assert eager._batch_prefill_wrappers[-1]._plan.work.chunk is not None, "the test would not catch a split"


def test_a_refused_cascade_replan_leaves_every_level_as_it_was():
    """The levels are checked and staged first and committed together: a re-plan refused at level 0 (here: another
    batch size than the graph's) leaves the last level's plan, which it would otherwise have rewritten, in place."""
    w = attnjit.MultiLevelCascadeAttentionWrapper(2, _ws(), use_cuda_graph=True)
    hq, b = 32, 4

    def plan(prefix_groups: int, suffix_pages: int):
        per = b // prefix_groups
        qo0 = i32([g * per for g in range(prefix_groups + 1)])
        kv0 = i32([g * 8 for g in range(prefix_groups + 1)])
        w.plan([qo0, i32(list(range(b + 1)))], [kv0, i32([r * suffix_pages for r in range(b + 1)])],
               [i32(list(range(8 * prefix_groups))), i32([100 + j for j in range(b * suffix_pages)])],
               [i32([16] * prefix_groups), i32([16] * b)], hq, 8, D, 16, causal=True, q_data_type=F16)

    plan(1, 2)
    plans = [x._plan for x in w._batch_prefill_wrappers]
    with pytest.raises(ValueError, match="cascade level 0: .*batch size"):
        plan(2, 3)
    assert [x._plan for x in w._batch_prefill_wrappers] == plans and w._plan is plans[-1]
    plan(1, 3)
    assert all(x._plan is not p for x, p in zip(w._batch_prefill_wrappers, plans))


def test_tensors_the_kernel_reads_may_not_share_memory_with_what_it_writes():
    """sinks, a variant's tensor parameters and per-head scales are read while out, lse and the workspace are
    written: a view of one of those is a race, refused like a q inside out."""
    ws = _ws(16)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws)
    meta = (i32([0, 1, 2]), i32([0, 1, 2]), i32([0, 1]), i32([PS, PS]), H, H, D, PS)
    w.plan(*meta, q_data_type=F16, sinks=True)
    q = torch.randn(2, H, D, dtype=F16)
    cache = torch.randn(4, 2, PS, H, D, dtype=F16)
    out, lse = torch.empty(2, H, D, dtype=F16), torch.empty(2, H, dtype=torch.float32)
    with pytest.raises(ValueError, match="lse shares memory with variant parameter 'sinks'"):
        w.run(q, cache, out=out, lse=lse, sinks=lse[1])
    with pytest.raises(ValueError, match="out shares memory with variant parameter 'sinks'"):
        w.run(q, cache, out=out, lse=lse, sinks=out.view(torch.float32)[0, 0, :H])
    with pytest.raises(ValueError, match="'sinks' shares memory with float_workspace_buffer"):
        w.run(q, cache, out=out, lse=lse, sinks=ws.view(torch.float32)[:H])
    with pytest.raises(NoGPUError):
        w.run(q, cache, out=out, lse=lse, sinks=torch.zeros(H))
    w8 = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws)
    w8.plan(*meta, q_data_type=F16, kv_data_type=torch.float8_e4m3fn)
    c8 = torch.zeros(4, 2, PS, H, D, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="lse shares memory with k_scale"):
        w8.run(q, c8, out=out, lse=lse, k_scale=lse[0])
    with pytest.raises(ValueError, match="v_scale shares memory with float_workspace_buffer"):
        w8.run(q, c8, out=out, lse=lse, v_scale=ws.view(torch.float32)[64:64 + H])


def test_a_mask_inside_the_workspace_is_refused_at_plan():
    """A packed_custom_mask carved out of float_workspace_buffer would be overwritten by partial states while the
    kernel reads it: refused when plan() binds it, before any run()."""
    ws = _ws(16)
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws)
    args = (i32([0, 1, 2]), i32([0, 2, 4]), i32([0, 1, 2, 3]), i32([PS, PS]), H, H, D, PS)
    with pytest.raises(ValueError, match="plan\\(\\)'s packed_custom_mask shares memory with float_workspace"):
        w.plan(*args, packed_custom_mask=ws[1024:1026], q_data_type=F16)
    w.plan(*args, packed_custom_mask=torch.full((2,), 255, dtype=torch.uint8), q_data_type=F16)


@pytest.mark.parametrize("make", [
    lambda ws: attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, jit_args=["my_variant"]),
    lambda ws: attnjit.BatchPrefillWithRaggedKVCacheWrapper(ws, jit_kwargs={"x": 1}),
    lambda ws: attnjit.BatchDecodeWithPagedKVCacheWrapper(ws, jit_args=["my_variant"]),
], ids=["paged", "ragged", "decode"])
def test_flashinfer_jit_variant_arguments_are_refused_not_ignored(make):
    """FlashInfer's jit_args define a custom variant; ignoring them would run plain attention."""
    with pytest.raises(NotImplementedError, match="attnjit.Variant"):
        make(_ws(1))


def test_a_nan_sm_scale_is_not_what_lets_a_graph_replan_through():
    """(A NaN never reaches the struct comparison: plan() refuses it first, so NaN != NaN cannot hide a change.)"""
    w, _ = _paged(1)
    with pytest.raises(ValueError, match="sm_scale"):
        _plan_paged(w, 1, sm_scale=math.nan)
