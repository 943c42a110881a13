"""The compiled scheduler (attnjit._cplan, attnjit/native/cplan.c) against the Python one it accelerates: the same
work records, split decisions and numbering, the same refusals, on thousands of random plans of every size; its
argument checks, its buffer growth, threads, and the ATTNJIT_NATIVE switch. tests/test_scheduler.py also holds it to
the loop oracle."""

from __future__ import annotations

import random
import shutil
import sysconfig
import threading
from pathlib import Path

import numpy as np
import pytest

from attnjit.families import tiles_for
from attnjit.ops import scheduler
from attnjit.specs import AttentionSpec

SPECS = [AttentionSpec(op=op, head_dim=d, page_size=16, dtype="bf16", group_size=g,
                       **({"mask": "causal"} if op == "prefill" else {}))
         for op in ("decode", "prefill") for d in (64, 128, 256) for g in (1, 4, 8)]
TILES = sorted({t for s in SPECS for t in tiles_for(s)}, key=lambda t: t.name)


def test_the_compiled_scheduler_is_built_where_a_compiler_is():
    """setup.py builds it wherever a C compiler is present (it is optional only where none is); a missing build on
    such a machine is an install that went wrong, not a reason to test only the Python path."""
    cc = sysconfig.get_config_var("CC") or "cc"
    if shutil.which(cc.split()[0]) is None and shutil.which("cc") is None:
        pytest.skip(f"no C compiler here ({cc}): attnjit plans in Python, which tests/test_scheduler.py covers")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip("no Python headers here (Python.h): the extension cannot build; attnjit plans in Python")
    assert scheduler._cplan is not None, "attnjit._cplan is not built: reinstall (pip install -e .) to build it"


needs_native = pytest.mark.skipif(scheduler._cplan is None, reason="attnjit._cplan is not built here")


def _random_plan(rng: random.Random) -> dict:
    tile = rng.choice(TILES)
    group = rng.choice([1, 2, 4, 7, 8, 64])
    causal = rng.random() < 0.5
    batch = rng.choice([0, 1, 2, 5, rng.randint(1, 40), rng.randint(1, 300), rng.randint(300, 2000)])
    kv = [rng.choice([0, 1, rng.randint(1, 300), rng.randint(1, 5000), rng.randint(5000, 60000)]) for _ in range(batch)]
    qo = [rng.choice([0, 1, 1, 1, rng.randint(1, 16), rng.randint(1, 400)]) for _ in range(batch)]
    if causal:
        qo = [min(q, k) for q, k in zip(qo, kv)]
    return dict(qo_lens=np.asarray(qo, dtype=np.int64), kv_lens=np.asarray(kv, dtype=np.int64),
                qo_offsets=np.cumsum([0] + qo[:-1], dtype=np.int64) if batch else np.zeros(0, np.int64),
                kv_bases=np.asarray([rng.randint(0, 10 ** 6) for _ in range(batch)], dtype=np.int64), group=group,
                tile=tile, causal=causal, num_kv_heads=rng.choice([1, 2, 8]), slots=rng.choice([16, 132, 264, 528]),
                max_slots=rng.choice([0, 8, 100, 10 ** 4, 10 ** 7]), allow_split=rng.random() < 0.8,
                fixed_chunk=rng.choice([None, None, None, 1, 64, 100, 1000, 4096]))


def _python(kw: dict, monkeypatch):
    monkeypatch.setenv("ATTNJIT_NATIVE", "0")
    try:
        return scheduler.plan_work(**kw), None
    except ValueError as exc:
        return None, str(exc)
    finally:
        monkeypatch.setenv("ATTNJIT_NATIVE", "1")


def _same(a: scheduler.WorkPlan, b: scheduler.WorkPlan) -> None:
    assert a.records.dtype == b.records.dtype == np.int32
    assert a.records.shape == b.records.shape and np.array_equal(a.records, b.records)
    assert (a.num_groups, a.chunk, a.num_slots, a.split_requests, a.slots_target, a.tile) == \
        (b.num_groups, b.chunk, b.num_slots, b.split_requests, b.slots_target, b.tile)


@needs_native
@pytest.mark.parametrize("part", range(3))
def test_compiled_and_python_schedulers_plan_the_same_work(part, monkeypatch):
    """3 x 1,000 random batches up to 2,000 requests (empty requests and histories, decode rows, long prefills,
    causal or not; auto, fixed and no split; workspaces from roomy to too small; inputs as arrays and as lists):
    equal plans, or the same error from both."""
    rng = random.Random(500 + part)
    seen = {"same": 0, "split": 0, "refused": 0, "big": 0}
    for _ in range(1000):
        kw = _random_plan(rng)
        want, error = _python(kw, monkeypatch)
        args = {k: (v.tolist() if isinstance(v, np.ndarray) and rng.random() < 0.3 else v) for k, v in kw.items()}
        if error is not None:
            with pytest.raises(ValueError) as got:
                scheduler.plan_work(**args)
            assert str(got.value) == error
            seen["refused"] += 1
            continue
        got = scheduler.plan_work(**args)
        _same(got, want)
        seen["same"] += 1
        seen["split"] += want.chunk is not None
        seen["big"] += len(want.records) > 1024  # past the first record buffer: it grows
    assert seen["same"] > 700 and seen["split"] > 150 and seen["refused"] > 20 and seen["big"] > 20, seen


@needs_native
def test_the_compiled_scheduler_checks_its_buffers():
    q = np.ones(4, dtype=np.int64)
    out = np.empty((8, 12), dtype=np.int32)
    rest = (1, 16, 64, False, 1, 132, 100, True, -1, 1 << 20)
    assert scheduler._cplan.plan_work(q, q, q, q, out, *rest)[:2] == (0, 4)
    with pytest.raises(TypeError, match="kv_lens must be a contiguous int64 buffer"):
        scheduler._cplan.plan_work(q, q.astype(np.int32), q, q, out, *rest)
    with pytest.raises(TypeError, match="qo_offsets must be a contiguous int64 buffer of the batch size"):
        scheduler._cplan.plan_work(q, q, q[:3], q, out, *rest)
    with pytest.raises(ValueError, match="not C-contiguous"):  # a strided view (numpy says so)
        scheduler._cplan.plan_work(np.ones(8, dtype=np.int64)[::2], q, q, q, out, *rest)
    with pytest.raises(TypeError, match="out must be a writable contiguous int32 buffer"):
        scheduler._cplan.plan_work(q, q, q, q, np.empty((8, 11), dtype=np.int32), *rest)
    with pytest.raises(ValueError, match="must be positive and slots"):
        scheduler._cplan.plan_work(q, q, q, q, out, 0, *rest[1:])
    # lengths plan() never passes (negative, or past 2^31): refused (5), for the Python path
    assert scheduler._cplan.plan_work(q, -q, q, q, out, *rest)[0] == 5
    assert scheduler._cplan.plan_work(q * (1 << 40), q, q, q, out, *rest)[0] == 5
    # too small an output buffer: the counts come back, nothing is written
    small = np.full((2, 12), -7, dtype=np.int32)
    assert scheduler._cplan.plan_work(q, q, q, q, small, *rest)[:2] == (3, 4) and (small == -7).all()


@needs_native
def test_native_planning_is_thread_safe(monkeypatch):
    """Each thread plans into its own record buffer: 4 threads x 200 plans, every one equal to the Python plan."""
    rng = random.Random(9)
    plans = []
    for _ in range(200):
        kw = _random_plan(rng)
        want, error = _python(kw, monkeypatch)
        if error is None:
            plans.append((kw, want))
    bad: list[str] = []

    def worker(seed: int) -> None:
        order = random.Random(seed).sample(range(len(plans)), len(plans))
        for i in order:
            kw, want = plans[i]
            try:
                _same(scheduler.plan_work(**kw), want)
            except AssertionError as exc:  # collected: an assertion in a thread would be lost
                bad.append(f"plan {i}: {exc}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad[:3]


def test_attnjit_native_0_plans_in_python(monkeypatch):
    """ATTNJIT_NATIVE=0: the compiled scheduler is not called at all."""
    if scheduler._cplan is not None:
        def boom(*a):
            raise AssertionError("the compiled scheduler ran with ATTNJIT_NATIVE=0")

        monkeypatch.setattr(scheduler._cplan, "plan_work", boom)
    monkeypatch.setenv("ATTNJIT_NATIVE", "0")
    kw = _random_plan(random.Random(3))
    kw["max_slots"] = 10 ** 7
    assert isinstance(scheduler.plan_work(**kw), scheduler.WorkPlan)
    monkeypatch.setenv("ATTNJIT_NATIVE", "maybe")
    with pytest.raises(ValueError, match="ATTNJIT_NATIVE='maybe' is invalid"):
        scheduler.plan_work(**kw)


def _random_table(rng: random.Random):
    """A host page table, valid or broken in one of the ways read_paged refuses, some as strided views."""
    import torch

    batch = rng.choice([0, 1, 3, rng.randint(1, 50), rng.randint(50, 600)])
    ps = rng.choice([1, 3, 16, 528])
    pages = [rng.choice([0, 1, 2, rng.randint(1, 40)]) for _ in range(batch)]
    indptr = [0]
    for n in pages:
        indptr.append(indptr[-1] + n)
    last = [rng.randint(1, ps) if n else 0 for n in pages]
    ids = [rng.randint(0, 10 ** 6) for _ in range(indptr[-1] + rng.choice([0, 0, 5]))]
    fault = rng.choice([None] * 6 + ["start", "decreasing", "last", "last0", "short", "negative", "huge"])
    if fault == "start" and indptr:
        indptr = [x + 1 for x in indptr]
    elif fault == "decreasing" and batch > 1:
        i = rng.randint(1, batch - 1)
        indptr[i] = indptr[i + 1] + 1
    elif fault == "last" and batch:
        last[rng.randrange(batch)] = rng.choice([-1, ps + 1, 2 ** 31 - 1])
    elif fault == "last0" and 0 in pages:
        last[pages.index(0)] = 1
    elif fault == "short" and ids:
        ids = ids[:-rng.randint(1, len(ids))] if indptr[-1] else ids
    elif fault == "negative" and indptr[-1]:
        ids[rng.randrange(indptr[-1])] = rng.choice([-1, -2 ** 31])
    elif fault == "huge" and batch:
        pages[0] = 1
        indptr = [0] + [x + 2 ** 21 for x in indptr[1:]]
        ids = [0] * (indptr[-1])
        ps, last = 1024, [1024] * batch

    def t(v):
        x = torch.tensor(v, dtype=torch.int32)
        if rng.random() < 0.3:  # the same values as a strided view
            x = torch.stack([x, x], 1)[:, 0]
        return x
    return t(indptr), t(ids), t(last), ps


@needs_native
def test_compiled_and_python_page_table_readers_agree(monkeypatch):
    """2,000 random host page tables, a third of them broken (indptr not from 0 or decreasing, a last_page_len
    outside its rule, too few page ids, a negative page id, a KV length past 2^30), some as strided views: the same
    Batch from both readers, or the same error."""
    from attnjit.ops import planner

    rng = random.Random(21)
    names = ("indptr", "indices", "last_page_len")
    seen = {"same": 0, "refused": 0}
    for _ in range(2000):
        indptr, ids, last, ps = _random_table(rng)
        qo = np.arange(indptr.numel(), dtype=np.int64)
        results = []
        for native in ("0", "1"):
            monkeypatch.setenv("ATTNJIT_NATIVE", native)
            try:
                results.append(planner.read_paged(names, qo, indptr, ids, last, page_size=ps))
            except ValueError as exc:
                results.append(str(exc))
        py, c = results
        if isinstance(py, str):
            assert c == py
            seen["refused"] += 1
            continue
        assert not isinstance(c, str), c
        for f in ("qo_indptr", "qo_lens", "kv_lens", "kv_bases"):
            assert np.array_equal(getattr(c, f), getattr(py, f)) and getattr(c, f).dtype == np.int64, f
        assert (c.max_page, c.num_page_ids) == (py.max_page, py.num_page_ids)
        seen["same"] += 1
    assert seen["same"] > 1000 and seen["refused"] > 300, seen


def _random_qo(rng: random.Random, b: int, kv_lens: list[int]):
    """qo_indptr for b requests: valid (some past their KV length, which causal refuses) or broken."""
    import torch

    qo = [0]
    for k in kv_lens + [rng.randint(0, 9)] * max(0, b - len(kv_lens)):
        qo.append(qo[-1] + rng.choice([0, 1, rng.randint(0, max(k, 1)), k, k + 1]))
    fault = rng.choice([None] * 5 + ["start", "decreasing", "rows", "length"])
    if fault == "start":
        qo[0] = rng.choice([1, -1])
    elif fault == "decreasing" and b > 0:
        qo[b] = qo[b - 1] - 1
    elif fault == "rows":
        qo[-1] = 2 ** 31 - 1
    elif fault == "length":
        qo = qo[:-1] if b > 0 else qo + [0]
    x = torch.tensor(qo, dtype=torch.int32)
    return torch.stack([x, x], 1)[:, 0] if rng.random() < 0.3 else x


@needs_native
def test_compiled_prefill_reader_agrees_with_the_python_readers(monkeypatch):
    """read_prefill (qo_indptr and the page table in one compiled call) = read_qo_indptr, check_meta's lengths and
    read_paged, with the longest request and the causal rule: on 2,000 random tables, a third broken; where the
    Python readers raise, the compiled one declines (None), so the caller reads again and raises."""
    import torch

    from attnjit.ops import planner

    rng = random.Random(8)
    names = ("indptr", "indices", "last_page_len")
    seen = {"same": 0, "declined": 0, "causal": 0}
    for _ in range(2000):
        indptr, ids, last, ps = _random_table(rng)
        kv = [0] * last.numel()
        qo = _random_qo(rng, last.numel(), kv)
        monkeypatch.setenv("ATTNJIT_NATIVE", "0")
        try:
            q = planner.read_qo_indptr("qo_indptr", qo)
            planner.check_meta("indptr", indptr, torch.device("cpu"), len(q))
            planner.check_meta("last_page_len", last, torch.device("cpu"), len(q) - 1)
            want = planner.read_paged(names, q, indptr, ids, last, page_size=ps)
        except ValueError:
            want = None
        monkeypatch.setenv("ATTNJIT_NATIVE", "1")
        got = planner.read_prefill(qo, indptr, ids, last, page_size=ps)
        if want is None:
            assert got is None
            seen["declined"] += 1
            continue
        assert got is not None
        for f in ("qo_indptr", "qo_lens", "kv_lens", "kv_bases"):
            assert np.array_equal(getattr(got, f), getattr(want, f)) and getattr(got, f).dtype == np.int64, f
        assert (got.max_page, got.num_page_ids) == (want.max_page, want.num_page_ids)
        assert got.longest_qo() == want.longest_qo() and want.max_qo_len is None
        assert got.causal_ok == (not (want.qo_lens > want.kv_lens).any())
        seen["same"] += 1
        seen["causal"] += got.causal_ok
    assert seen["same"] > 700 and seen["declined"] > 300 and 100 < seen["causal"] < seen["same"], seen
    monkeypatch.setenv("ATTNJIT_NATIVE", "0")   # off: the Python readers serve
    assert planner.read_prefill(*(torch.tensor(v, dtype=torch.int32) for v in ([0, 1], [0, 1], [4], [1])),
                                page_size=16) is None


@needs_native
def test_the_compiled_functions_survive_garbage():
    """Arbitrary int64 lengths and int32 page tables (extremes included) straight into attnjit._cplan: each call
    returns (a refusal or a result within its buffers); none crashes or writes past them."""
    rng = np.random.default_rng(4)
    extremes = np.array([0, 1, -1, 2 ** 31 - 1, -2 ** 31, 2 ** 62, -2 ** 63, 2 ** 63 - 1], dtype=np.int64)
    for _ in range(3000):
        n = int(rng.integers(0, 40))
        arrays = [rng.choice(extremes, n) if rng.random() < 0.5 else rng.integers(-5, 5000, n) for _ in range(4)]
        out = np.full((int(rng.integers(1, 64)) + 1, 12), -7, dtype=np.int32)
        guard = out[-1].copy()
        view = out[:-1]
        params = [int(rng.choice([1, 4, 64])), int(rng.choice([16, 64, 128])), int(rng.choice([16, 64, 128])),
                  bool(rng.random() < 0.5), int(rng.choice([1, 8, 2 ** 31 - 1])), int(rng.choice([1, 132, 2 ** 62])),
                  int(rng.choice([0, 100, 2 ** 62])), bool(rng.random() < 0.8), int(rng.choice([-1, 1, 2 ** 40])),
                  1 << 20]
        try:
            status, count, *_ = scheduler._cplan.plan_work(*[a.astype(np.int64) for a in arrays], view, *params)
        except ValueError as exc:  # heads past 2^20: refused before any work
            assert "num_kv_heads (1..2^20)" in str(exc) and params[4] > 1 << 20
            continue
        assert status in (0, 1, 2, 3, 5) and (status != 0 or 0 <= count <= len(view))
        assert (out[-1] == guard).all()
    for _ in range(3000):
        b = int(rng.integers(0, 30))
        ind = rng.integers(-2 ** 31, 2 ** 31, b + 1, dtype=np.int64).astype(np.int32) if rng.random() < 0.5 else \
            np.cumsum(rng.integers(0, 5, b + 1)).astype(np.int32) - 1
        last = rng.integers(-2 ** 31, 2 ** 31, b, dtype=np.int64).astype(np.int32)
        ids = rng.integers(-2 ** 31, 2 ** 31, int(rng.integers(0, 100)), dtype=np.int64).astype(np.int32)
        lens, bases = np.empty(b, dtype=np.int64), np.empty(b, dtype=np.int64)
        status, used, max_page = scheduler._cplan.read_paged(ind, last, ids, int(rng.choice([1, 16, 1024])),
                                                             1 << 30, lens, bases)
        assert status in (0, 1, 2, 3, 4, 5) and (status != 0 or 0 <= used <= len(ids))
        qo = rng.integers(-2 ** 31, 2 ** 31, b + 1, dtype=np.int64).astype(np.int32) if rng.random() < 0.5 else \
            np.cumsum(rng.integers(0, 5, b + 1)).astype(np.int32) - int(rng.integers(0, 2))
        q64, qlens = np.empty(b + 1, dtype=np.int64), np.empty(b, dtype=np.int64)
        status, used, max_page, max_qo, ok = scheduler._cplan.read_prefill(
            qo, ind, last, ids, int(rng.choice([1, 16, 1024])), 1 << 30, 1 << 24, q64, qlens, lens, bases)
        assert status in (0, 1, 2, 3, 4, 5, 6, 7) and (status != 0 or (0 <= used <= len(ids) and ok in (0, 1)))


@needs_native
def test_long_work_lists_get_their_own_array(monkeypatch):
    """Past the thread's buffer (grown up to _KEEP_ROWS records) a work list is written into its own array: the same
    records as Python's, and a later plan does not overwrite them."""
    tile = next(t for t in TILES if t.cta_kv == 64)
    kw = dict(qo_lens=np.ones(400, dtype=np.int64), kv_lens=np.full(400, 64 * 100, dtype=np.int64),
              qo_offsets=np.arange(400, dtype=np.int64), kv_bases=np.arange(400, dtype=np.int64) * 100, group=4,
              tile=tile, causal=False, num_kv_heads=8, slots=132, max_slots=10 ** 7, allow_split=True,
              fixed_chunk=64)
    want, _ = _python(kw, monkeypatch)
    got = scheduler.plan_work(**kw)
    assert len(got.records) == 40000 > scheduler._KEEP_ROWS
    _same(got, want)
    again = got.records.copy()
    scheduler.plan_work(**dict(kw, kv_lens=np.full(400, 64 * 99, dtype=np.int64)))
    assert np.array_equal(got.records, again)
