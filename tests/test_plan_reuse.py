"""What plan() reuses across calls, held to what a fresh start gives: the staging buffers of the upload (never
rewritten while a copy from them may be in flight; the event logic runs here with a fake event), the per-key memo of
the kernel, occupancy, launch and parameter struct (a re-plan on the same wrapper = a plan on a fresh one), and the
graph-mode fixed buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnjit.ops._upload import MetadataBuffers, Staging
from tests.helpers import i32


class InFlight:
    """A copy's event that completes only when the test says so (a CUDA event, as the upload sees one)."""

    made: list["InFlight"] = []

    def __init__(self):
        self.done = True   # a fresh event has recorded nothing: nothing to wait for
        InFlight.made.append(self)

    def record(self):
        self.done = False

    def query(self):
        return self.done


def _work(n: int, start: int = 0) -> np.ndarray:
    return (start + np.arange(n * 12, dtype=np.int32)).reshape(n, 12)


def _upload(meta, records, ids, keep):
    return meta.upload(records, num_groups=1, num_kv_heads=2, page_ids=ids, used=ids.numel(), keep=keep)


def test_staging_is_not_rewritten_while_its_copy_is_in_flight():
    InFlight.made.clear()
    meta = MetadataBuffers(torch.device("cpu"), use_cuda_graph=False, max_work_items=None, new_event=InFlight)
    keep_a: list = []
    _upload(meta, _work(3), i32([7, 8, 9]), keep_a)
    (a,) = meta.staging
    staged_a = a.host[:4 + 36 + 2 + 3].copy()
    assert staged_a[:4].tolist() == [3, 0, 0, 0] and staged_a[-3:].tolist() == [7, 8, 9]
    # a's copy is still in flight: the next plan stages elsewhere and a's bytes stay as they were
    keep_b: list = []
    _upload(meta, _work(5, 1000), i32([1, 2]), keep_b)
    assert len(meta.staging) == 2 and meta.staging[0] is a
    b = meta.staging[1]
    assert a.host[:len(staged_a)].tolist() == staged_a.tolist()
    # both in flight: a third plan takes a buffer of its own, the kept two are untouched
    _upload(meta, _work(1, 5000), i32([4]), [])
    assert meta.staging == [a, b] and a.host[:len(staged_a)].tolist() == staged_a.tolist()
    # every plan's device copy holds its own metadata
    assert keep_a[0][:len(staged_a)].tolist() == staged_a.tolist()
    assert keep_b[0][:4].tolist() == [5, 0, 0, 0] and keep_b[0][4:64].tolist() == list(range(1000, 1060))
    assert keep_b[0][4 + 60 + 2:4 + 60 + 4].tolist() == [1, 2]
    # a's copy completes: a is reused (not a new buffer), and so is b once its copy has run
    a.event.done = True
    _upload(meta, _work(2, 7), i32([3, 3]), [])
    assert meta.staging == [a, b] and a.host[:4].tolist() == [2, 0, 0, 0]
    b.event.done = True
    _upload(meta, _work(2, 9), i32([5]), [])
    assert meta.staging == [a, b] and b.host[:4].tolist() == [2, 0, 0, 0]


def test_staging_grows_only_a_buffer_whose_copy_has_run():
    meta = MetadataBuffers(torch.device("cpu"), use_cuda_graph=False, max_work_items=None, new_event=InFlight)
    _upload(meta, _work(1), i32([1]), [])
    small = meta.staging[0]
    small.event.done = True
    keep: list = []
    big = _work(200)
    _upload(meta, big, i32(list(range(500))), keep)
    (grown,) = meta.staging
    assert grown is not small and grown.size >= 4 + big.size + 2 + 500
    assert keep[0][4:4 + big.size].tolist() == big.reshape(-1).tolist()
    at = 4 + big.size + 2
    assert keep[0][at:at + 500].tolist() == list(range(500))
    # a CUDA device gets pinned buffers and CUDA events; a CPU "device" neither (its copies are synchronous)
    assert not Staging(8, False, None).tensor.is_pinned() and Staging(8, False, None).free()


def test_a_device_buffer_is_reused_only_once_no_plan_holds_it():
    """A plan keeps its device buffer's lease; a later upload takes a kept buffer only where no plan holds its lease
    (the current plan's, a failed plan's dropped) and its last copy went on the same stream, else a fresh one."""
    meta = MetadataBuffers(torch.device("cpu"), use_cuda_graph=False, max_work_items=None)
    keep_a: list = []
    _upload(meta, _work(3), i32([7, 8, 9]), keep_a)
    a = keep_a[0]
    image_a = a[:4 + 36 + 2 + 3].tolist()
    keep_b: list = []
    _upload(meta, _work(5, 1000), i32([1, 2]), keep_b)      # a is held: b is another buffer
    b = keep_b[0]
    assert b.data_ptr() != a.data_ptr() and a[:len(image_a)].tolist() == image_a
    del keep_b                                              # b's plan failed (or was replaced): b is free
    keep_c: list = []
    _upload(meta, _work(2, 50), i32([4]), keep_c)
    assert keep_c[0] is b and a[:len(image_a)].tolist() == image_a and b[:4].tolist() == [2, 0, 0, 0]
    keep_d: list = []                                       # both held: a fresh one, not kept
    _upload(meta, _work(1, 70), i32([6]), keep_d)
    assert keep_d[0].data_ptr() not in (a.data_ptr(), b.data_ptr()) and len(meta._dev) == 2
    assert a[:len(image_a)].tolist() == image_a and b[:4].tolist() == [2, 0, 0, 0]
    del keep_a, keep_c
    # a free buffer whose last copy went on another stream is not taken; one too small is replaced
    buf, lease = meta._device_buffer(8, 1234)
    assert buf.data_ptr() not in (a.data_ptr(), b.data_ptr())
    del buf, lease
    big, lease = meta._device_buffer(5000, None)
    assert big.numel() >= 5000 and big.data_ptr() not in (a.data_ptr(), b.data_ptr())


def test_graph_mode_keeps_one_allocation_for_its_own_page_ids():
    """The wrapper's own page-id buffer lies in the metadata allocation (host page ids: one copy); an engine's
    buffer stays the engine's. Either way every plan's regions hold what it planned and the addresses stay."""
    meta = MetadataBuffers(torch.device("cpu"), use_cuda_graph=True, max_work_items=None, new_event=InFlight)
    p1 = _upload(meta, _work(3), i32([4, 5, 6]), [])
    fixed, ids = meta.fixed_meta, meta.fixed_page_ids
    assert ids.data_ptr() == fixed.data_ptr() + 4 * meta.ids_at and meta.ids_at % 4 == 0
    assert p1["kv_indices"] == ids.data_ptr() and ids[:3].tolist() == [4, 5, 6]
    at_tickets = 4 + 12 * meta.caps[0]
    assert fixed[at_tickets:at_tickets + 2].tolist() == [0, 0]
    fixed[at_tickets] = 9  # a kernel took a ticket; the next plan must start them at zero again
    p2 = _upload(meta, _work(2, 100), i32([1, 2]), [])   # the first staging buffer is in flight: the other one
    assert p2 == p1 and fixed[:4].tolist() == [2, 0, 0, 0] and fixed[4:28].tolist() == list(range(100, 124))
    assert fixed[at_tickets:at_tickets + 2].tolist() == [0, 0] and ids[:2].tolist() == [1, 2]
    device_ids = i32([8, 9, 10])   # page ids "on the device": copied into the fixed buffer
    p3 = _upload(meta, _work(1, 50), device_ids, [])   # both in flight: a one-off staging buffer
    assert p3 == p1 and ids[:3].tolist() == [8, 9, 10] and fixed[4:16].tolist() == list(range(50, 62))
    engine = torch.zeros(16, dtype=torch.int32)
    other = MetadataBuffers(torch.device("cpu"), use_cuda_graph=True, max_work_items=None, new_event=InFlight)
    other.fixed_page_ids = engine
    q1 = _upload(other, _work(2), i32([3, 1]), [])
    assert other.ids_at is None and q1["kv_indices"] == engine.data_ptr() and engine[:2].tolist() == [3, 1]
    engine[:3] = i32([5, 6, 7])   # the engine writes the page ids in place (FlashInfer's pattern)
    assert _upload(other, _work(2), engine[:3], [])["kv_indices"] == engine.data_ptr()
    assert engine[:3].tolist() == [5, 6, 7]


# --- the per-key memo: a re-plan on one wrapper = a plan on a fresh wrapper --------------------------------------

def _batch(rng, kind: str):
    batch = rng.randint(1, 300) if rng.random() < 0.3 else rng.randint(1, 12)
    kv = [rng.randint(0 if kind == "decode" else 1, 5000) for _ in range(batch)]
    qo = [1] * batch if kind == "decode" else [rng.randint(0, min(k, 300)) for k in kv]
    qo_indptr, kv_indptr, pages = [0], [0], [0]
    for q, k in zip(qo, kv):
        qo_indptr.append(qo_indptr[-1] + q)
        kv_indptr.append(kv_indptr[-1] + k)
        pages.append(pages[-1] + -(-k // 16))
    last = [k - 16 * (-(-k // 16) - 1) if k else 0 for k in kv]
    ids = i32(rng.sample(range(pages[-1] + 10), pages[-1]))
    return dict(qo_indptr=i32(qo_indptr), kv_indptr=i32(kv_indptr), pages=i32(pages), last=i32(last), ids=ids)


def _options(rng, kind: str) -> dict:
    """Scalar options that change the plan key (heads, scale, split, variants) or not (window, soft-cap values)."""
    hkv = rng.choice([1, 2, 8])
    opts = dict(num_qo_heads=hkv * rng.choice([1, 4, 8]), num_kv_heads=hkv, q_data_type=torch.bfloat16)
    if rng.random() < 0.3:
        opts["sm_scale"] = rng.choice([0.05, 0.125])
    if rng.random() < 0.3:
        opts["logits_soft_cap"] = rng.choice([30.0, 50.0])
    if rng.random() < 0.2:
        opts["window_left"] = rng.choice([64, 1000])
    if rng.random() < 0.2:
        opts["pos_encoding_mode"] = "ALIBI"
    if rng.random() < 0.2:
        opts["fixed_split_size"] = rng.choice([256, 1000])
    if rng.random() < 0.2:
        opts["disable_split_kv"] = True
    if kind != "decode":
        opts["causal"] = rng.random() < 0.7
    return opts


def _args(kind: str, b: dict, opts: dict) -> dict:
    if kind == "decode":
        return dict(indptr=b["pages"], indices=b["ids"], last_page_len=b["last"], head_dim=128, page_size=16, **opts)
    if kind == "paged":
        return dict(qo_indptr=b["qo_indptr"], paged_kv_indptr=b["pages"], paged_kv_indices=b["ids"],
                    paged_kv_last_page_len=b["last"], head_dim_qk=128, page_size=16, **opts)
    return dict(qo_indptr=b["qo_indptr"], kv_indptr=b["kv_indptr"], head_dim_qk=128, **opts)


def _state(plan) -> tuple:
    return (plan.spec, plan.work.tile, plan.work.records.tolist(), plan.work.chunk, plan.work.num_groups,
            plan.work.num_slots, plan.decision(), plan.attn_values, plan.variant_slots, plan.sched, plan.settings,
            plan.max_page, plan.total_kv, plan.q_shape, sorted(plan.binding.bound))


@pytest.mark.parametrize("kind", ["decode", "paged", "ragged"])
def test_a_replan_on_one_wrapper_is_a_fresh_plan(kind, monkeypatch):
    """Random plans on one wrapper (other metadata; other heads, scales and variants: other keys) each give what
    a fresh wrapper plans, so nothing a key memoized leaks into another key's plans; the SM count a CPU plan
    assumes (ATTNJIT_NUM_SMS) is part of the key."""
    import random

    from tests.plan_support import WRAPPERS, workspace

    rng = random.Random(13)
    make, _ = WRAPPERS[kind]
    w = make(workspace())
    seen = set()
    for step in range(60):
        if step == 40:
            monkeypatch.setenv("ATTNJIT_NUM_SMS", "16")
        opts = _options(rng, kind) if step % 3 else dict(num_qo_heads=32, num_kv_heads=8,
                                                         q_data_type=torch.bfloat16, causal=True)
        if kind == "decode":
            opts.pop("causal", None)
        args = _args(kind, _batch(rng, kind), opts)
        outcome = []
        for wrapper in (w, make(workspace())):
            try:
                wrapper.plan(**args)
                outcome.append(_state(wrapper._plan))
            except ValueError as exc:  # too many partial states for the workspace: the same error both times
                outcome.append(str(exc))
        assert outcome[0] == outcome[1], (step, opts)
        if not isinstance(outcome[0], str):
            seen.add((w._plan.spec, w._plan.work.tile))
    assert len(w._prepared) >= len(seen) > 4   # several keys were memoized side by side


def test_the_checked_scalar_arguments_are_reused_only_for_the_same_values_and_types(monkeypatch):
    """plan()'s checks of its scalar arguments run once for a run of plans with the same ones (an engine's decode
    steps): another value, or the same value as another type (1 for True, 128.0 for 128), is checked afresh, and a
    bad argument raises every time."""
    from attnjit.ops import planner as P
    from tests.plan_support import WRAPPERS, workspace

    calls = []
    real = P.plan_options
    monkeypatch.setattr(P, "plan_options", lambda **kw: calls.append(kw) or real(**kw))
    rng = __import__("random").Random(5)
    w = WRAPPERS["paged"][0](workspace())
    base = dict(num_qo_heads=32, num_kv_heads=8, q_data_type=torch.bfloat16, causal=True)
    for _ in range(3):
        w.plan(**_args("paged", _batch(rng, "paged"), base))
    assert len(calls) == 1
    first = _state(w._plan)
    with pytest.raises(TypeError, match="causal must be True or False"):  # 1 == True, but it is checked again
        w.plan(**_args("paged", _batch(rng, "paged"), dict(base, causal=1)))
    w.plan(**_args("paged", _batch(rng, "paged"), dict(base, sm_scale=0.1)))
    assert len(calls) == 3
    with pytest.raises(TypeError, match="head_dim_qk"):
        w.plan(**dict(_args("paged", _batch(rng, "paged"), base), head_dim_qk=128.0))
    for _ in range(2):
        with pytest.raises(ValueError, match="sm_scale"):
            w.plan(**_args("paged", _batch(rng, "paged"), dict(base, sm_scale=float("nan"))))
    b = _batch(__import__("random").Random(99), "paged")
    w.plan(**_args("paged", b, base))
    fresh = WRAPPERS["paged"][0](workspace())
    fresh.plan(**_args("paged", b, base))
    assert _state(w._plan) == _state(fresh._plan) and first[0] == w._plan.spec


# --- device metadata: one device-to-host copy, the page-id range reduced where the ids lie -----------------------

def test_the_masked_page_range_is_the_range_of_the_used_ids():
    """masked_range (what plan() computes on the device when indptr is there too) = min/max of indices[:end],
    whatever lies past end (negative garbage included)."""
    import random

    from attnjit.ops import planner

    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 3000)
        ids = [rng.randint(0, 10 ** 6) for _ in range(n)]
        end = rng.randint(1, n)
        ids[end:] = [rng.randint(-(2 ** 31), 2 ** 31 - 1) for _ in range(n - end)]
        lo, hi = planner.masked_range(i32(ids), i32([0, end])[-1])
        assert (int(lo), int(hi)) == (min(ids[:end]), max(ids[:end]))
    assert planner.device_page_range(i32([]), i32([0, 0])) is None
    assert planner.device_page_range(i32([5]), i32([])) is None
    assert planner.device_page_range(i32([5, -1]), i32([0, 0])) is None   # nothing used: nothing to range
    # up to RAW_PAGE_IDS page ids travel to the host as they are (host indptr: the used part only) ...
    (ids,) = planner.device_page_range(i32([5, 2, -1]), i32([0, 2]))
    assert ids.tolist() == [5, 2]
    # (with indptr on the device too, all of them: tests/gpu/test_plan_host.py)


def test_many_page_ids_are_reduced_first_and_both_forms_give_the_same_checks(monkeypatch):
    """Past RAW_PAGE_IDS the device reduces the page ids to (min, max) before the copy; read_paged gives the same
    largest page id, and the same error for a negative one, from either form (garbage past indptr[-1] ignored)."""
    from attnjit.ops import planner

    ids, kvp, last = i32([7, 3, 9, 4, -5, 123456]), i32([0, 2, 4]), i32([16, 16])
    qo = np.arange(3)
    raw = planner.device_page_range(ids, i32([0, 2, 4]))
    monkeypatch.setattr(planner, "RAW_PAGE_IDS", 2)
    reduced = planner.device_page_range(ids, i32([0, 2, 4]))
    assert len(raw) == 1 and len(reduced) == 2
    names = ("kv_indptr", "kv_indices", "kv_last_page_len")
    for rng in (raw, reduced):
        batch = planner.read_paged(names, qo, kvp, ids, last, page_size=16, page_range=rng)
        assert batch.max_page == 9
    bad = i32([7, -3, 9, 4])
    for rng in (planner.device_page_range(bad, i32([0, 2, 4])), None):
        with pytest.raises(ValueError, match=r"kv_indices\[1\]=-3"):
            planner.read_paged(names, qo, kvp, bad, last, page_size=16, page_range=rng)



# --- merge_state's eager path: one memo lookup, the parameter struct in PARAMS' order -----------------------------

def test_merge_struct_and_launch_memo(monkeypatch):
    """The struct merge_state(s) fill by position = PARAMS' fields by name, for strided views too; one Launch set per
    (dtype, head_dim, device), forgotten by dispatch.clear_memory() with the modules."""
    from attnjit import dispatch
    from attnjit.generator import PARAMS
    from attnjit.ops import merge

    made = []

    class Launch:
        def __init__(self, op, kernel, grid):
            self.kernel, self.grid = kernel, grid
            made.append(self)

        def __call__(self, values):
            self.values = values

    class Module:
        kernels = {"attnjit_merge_state": "two", "attnjit_merge_states": "many"}

    monkeypatch.setattr(merge, "require_cuda", lambda *a: None)
    monkeypatch.setattr(dispatch, "module", lambda spec, device: Module)
    monkeypatch.setattr(dispatch, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(dispatch, "Launch", Launch)
    dispatch.clear_memory()
    try:
        table = torch.randn(7, 3, 40, 64).to(torch.bfloat16)
        va, vb = table[:, 0, :32], table[:, 2, 8:]            # [7, 32, 64] views, strides (7680, 64, 1)
        sa, sb = torch.randn(32, 7).t(), torch.randn(7, 32)  # any lse view
        v, s = merge.merge_state_eager(va, sa, vb, sb)
        two = next(m for m in made if m.kernel == "two")
        want = PARAMS["merge_two"].values(
            v_a=va.data_ptr(), lse_a=sa.data_ptr(), v_b=vb.data_ptr(), lse_b=sb.data_ptr(), v_out=v.data_ptr(),
            lse_out=s.data_ptr(), mask=0, num_rows=7, num_heads=32, v_a_stride_n=va.stride(0),
            v_a_stride_h=va.stride(1), v_b_stride_n=vb.stride(0), v_b_stride_h=vb.stride(1),
            v_out_stride_n=v.stride(0), v_out_stride_h=v.stride(1), lse_a_stride_n=sa.stride(0),
            lse_a_stride_h=sa.stride(1), lse_b_stride_n=sb.stride(0), lse_b_stride_h=sb.stride(1),
            lse_out_stride_n=s.stride(0), lse_out_stride_h=s.stride(1))
        assert two.values == want and two.grid == (-(-7 * 32 * 8 // 128), 1, 1)
        mask = torch.ones(7, dtype=torch.bool)
        merge.merge_state_in_place_eager(va, sa, vb, sb, mask)
        assert two.values[:7] == [va.data_ptr(), sa.data_ptr(), vb.data_ptr(), sb.data_ptr(), va.data_ptr(),
                                  sa.data_ptr(), mask.data_ptr()]
        vm, sm = table[:, :2, :16].transpose(0, 1), torch.randn(2, 7, 16)   # [2 rows, 7 states, 16 heads, 64]
        out, lse = merge.merge_states_eager(vm, sm)
        many = next(m for m in made if m.kernel == "many")
        assert many.values == PARAMS["merge_many"].values(
            v=vm.data_ptr(), lse=sm.data_ptr(), v_out=out.data_ptr(), lse_out=lse.data_ptr(), num_rows=2,
            num_states=7, num_heads=16, v_stride_n=vm.stride(0), v_stride_s=vm.stride(1), v_stride_h=vm.stride(2),
            lse_stride_n=sm.stride(0), lse_stride_s=sm.stride(1), lse_stride_h=sm.stride(2),
            v_out_stride_n=out.stride(0), v_out_stride_h=out.stride(1), lse_out_stride_n=lse.stride(0),
            lse_out_stride_h=lse.stride(1))
        assert len(made) == 2                                  # one Launch per kernel of the key, reused
        merge.merge_state_eager(va.to(torch.float16), sa, vb.to(torch.float16), sb)
        assert len(made) == 4                                  # another dtype: another key
        dispatch.clear_memory()
        merge.merge_state_eager(va, sa, vb, sb)
        assert len(made) == 6                                  # the modules forgotten: the Launches too
    finally:
        dispatch.clear_memory()


def test_the_cache_memo_sees_memory_moved_under_the_same_tensor():
    """run() skips re-deriving a cache it saw last time; a cache object whose memory was swapped in place
    (``cache.data = ...``, as offloading engines do) is a new cache: its pointers and page count are checked
    again (a stale memo would have the kernels read the freed memory)."""
    import attnjit

    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(i32([0, 2, 5]), i32(range(5)), i32([3, 16]), 32, 8, 128, 16, q_data_type=torch.bfloat16)
    cache = torch.zeros(6, 2, 16, 8, 128, dtype=torch.bfloat16)
    first = w._check_cache(w._plan, cache)
    assert w._check_cache(w._plan, cache) is first  # the memo
    cache.data = torch.zeros(6, 2, 16, 8, 128, dtype=torch.bfloat16)  # same object, other memory
    moved = w._check_cache(w._plan, cache)
    assert moved is not first and moved.k.data_ptr() == cache.data_ptr() != first.k.data_ptr()
    cache.data = torch.zeros(2, 2, 16, 8, 128, dtype=torch.bfloat16)  # fewer pages than the plan's page table uses
    with pytest.raises(ValueError, match="uses page id 4 but paged_kv_cache has 2 pages"):
        w._check_cache(w._plan, cache)


def test_runtime_copies_only_on_a_cuda_device_and_read_back_falls_back_to_the_planner(monkeypatch):
    """RawCuda (CuPy's runtime calls) is chosen only for a CUDA device and not with ATTNJIT_NATIVE=0; a CPU
    "device" or a test's fake events keep torch's copies. MetadataBuffers.to_host returns host metadata as it is
    and gives planner.to_host's answer otherwise (the GPU tests check the runtime read-back itself)."""
    from attnjit.ops import _upload, planner

    assert _upload.raw_cuda(torch.device("cpu")) is None
    monkeypatch.setenv("ATTNJIT_NATIVE", "0")
    assert _upload.raw_cuda(torch.device("cuda", 0)) is None
    monkeypatch.delenv("ATTNJIT_NATIVE")
    meta = MetadataBuffers(torch.device("cpu"), use_cuda_graph=False, max_work_items=None)
    assert meta.raw is None
    assert MetadataBuffers(torch.device("cpu"), False, None, new_event=InFlight).raw is None
    a, b = i32([0, 3, 5]), i32([2, 1])
    got = meta.to_host(a, b)
    assert got[0] is a and got[1] is b
    assert [t.tolist() for t in meta.to_host(a, b[::1])] == [t.tolist() for t in planner.to_host(a, b)]
