"""The compiled scheduler (attnjit._cplan, attnjit/native/cplan.c) against the Python one it accelerates: the same
work records, split decisions and numbering, the same refusals, on thousands of random plans of every size; its
argument checks, its buffer growth, threads, and the ATTNJIT_NATIVE switch. tests/test_scheduler.py also holds it to
the loop oracle."""

from __future__ import annotations

import random
import shutil
import sysconfig
import threading

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
    with pytest.raises(ValueError, match="must be positive"):
        scheduler._cplan.plan_work(q, q, q, q, out, 0, *rest[1:])
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
