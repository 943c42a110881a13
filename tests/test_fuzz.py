"""Fuzzing every op's argument checks (issue 10): 10,700 generated calls with a fixed seed, on the CPU.

Each example is a call that is mostly valid, with zero to two fields mutated (dtypes, devices, shapes, strides,
lengths, ranges, scalars). tests/fuzz_oracle.py, an independent predicate written from the contracts, says which
arguments break a rule. Then:

- valid: plan() must succeed (and plan the same work for strided or offset views as for dense copies of them);
  run(), append and merge must get through every check to attnjit's NoGPUError (this machine has no GPU);
- invalid: the call must raise ValueError, TypeError or NotImplementedError (the allowed set: a bad value, a bad
  type, a FlashInfer feature attnjit lacks), with a message that names one of the broken arguments;
- anything else (IndexError, OverflowError, RuntimeError, struct.error, MemoryError, a hang) fails;
- every call runs under a 1 s alarm, so a hang fails at once (and Hypothesis' 1 s deadline holds too).

Hypothesis drives the examples (count, seed, deadline, the report of a failing one); each example's case comes from
a random.Random seeded by the one integer Hypothesis draws, so an example costs about a millisecond instead of the
tens of milliseconds that forty Hypothesis draws cost. A failure message carries the case. The module takes about
a minute on 2 cores (budget: well under 2 minutes).
"""

from __future__ import annotations

import random
import re
import signal
import sys
from collections import Counter
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st

import attnjit
from attnjit.errors import NoGPUError
from tests import fuzz_oracle as O
from tests.fuzz_cases import (CPU, WORKSPACE, WRAPPERS, dense_copy, draw_append, draw_merge, draw_plan, draw_run,
                              plan_facts)

SEED = 20261201
EXAMPLES = {"paged": 3000, "decode": 2500, "ragged": 2500, "append": 1500, "merge": 1200}   # 10,700 calls
ALLOWED = (ValueError, TypeError, NotImplementedError)
DEADLINE_S = 1.0


def fuzz(kind: str):
    """The Hypothesis wrapper of one fuzz loop: a fixed seed, EXAMPLES[kind] examples, the deadline."""
    def wrap(fn):
        return seed(SEED)(settings(max_examples=EXAMPLES[kind], deadline=DEADLINE_S * 1000, database=None,
                                   phases=(Phase.generate,), suppress_health_check=list(HealthCheck))(
            given(case_seed=st.integers(0, 2 ** 63 - 1))(fn)))
    return wrap


# --- the verdict ----------------------------------------------------------------------------------------------

class Hang(BaseException):
    """A call ran past the deadline (raised by the alarm; a BaseException, so no ``except Exception`` eats it)."""


@contextmanager
def alarm(seconds: float):
    def ring(signum, frame):
        raise Hang(f"ran over {seconds} s")
    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


_BEFORE = r"(?:^|[\s(\[,/]|(?<![A-Za-z0-9_])['`])"
_AFTER = r"(?=[\s.\[:=),/'`]|$)"


def names_one(message: str, names: set[str]) -> bool:
    """The message names one of the arguments (as a word: 'indptr' does not match inside 'qo_indptr')."""
    return any(re.search(_BEFORE + re.escape(n) + _AFTER, message) for n in names)


def describe(args: dict) -> str:
    def one(v):
        if isinstance(v, torch.Tensor):
            small = v.device.type == "cpu" and v.numel() <= 16
            return (f"Tensor({v.dtype}, {tuple(v.shape)}, stride {v.stride()}, offset {v.storage_offset()}, "
                    f"{v.device}{', ' + str(v.tolist()) if small else ''})")
        if isinstance(v, tuple):
            return "(" + ", ".join(one(x) for x in v) + ")"
        return repr(v)
    return "{" + ", ".join(f"{k}: {one(v)}" for k, v in args.items()) + "}"


def verdict(call, bad: set[str], stats: Counter, what: str, args: dict, *, valid_raises=None):
    """Run ``call`` under the alarm and hold it to the oracle's ``bad`` set. ``valid_raises``: the exception a valid
    call ends in here (NoGPUError for what needs a GPU); None: a valid call returns."""
    case = f"\n  case: {describe(args)}"
    try:
        with alarm(DEADLINE_S):
            call()
    except Hang as exc:
        raise AssertionError(f"{what}: hang ({exc}); the oracle says {sorted(bad) or 'valid'}{case}") from None
    except Exception as exc:  # noqa: BLE001 (the point is to classify it)
        if valid_raises is not None and isinstance(exc, valid_raises):
            assert not bad, f"{what}: an invalid call ({sorted(bad)}) got through every check: {exc}{case}"
            stats["valid"] += 1
            return
        if not isinstance(exc, ALLOWED):
            raise AssertionError(f"{what}: {type(exc).__name__} is not an allowed error: {exc}{case}") from exc
        assert bad, f"{what}: a valid call was rejected: {type(exc).__name__}: {exc}{case}"
        assert names_one(str(exc), bad), f"{what}: the message names none of {sorted(bad)}: {exc}{case}"
        stats["invalid"] += 1
        stats[type(exc).__name__] += 1
        return
    assert valid_raises is None, f"{what}: returned where it needs a GPU{case}"
    assert not bad, f"{what}: accepted an invalid call ({sorted(bad)}){case}"
    stats["valid"] += 1


def check_plan_and_run(kind: str, rng: random.Random, stats: Counter) -> None:
    a = draw_plan(rng, kind)
    layout = rng.choice(["NHD", "HND"]) if kind != "ragged" else "NHD"
    bad = O.plan_violations(kind, a, CPU)
    w = WRAPPERS[kind](WORKSPACE, kv_layout=layout)
    verdict(lambda: w.plan(**a), bad, stats, f"{kind} plan", a)
    if bad:
        assert w.last_plan is None, "a rejected plan() left a plan behind"
        return
    views = [k for k, v in a.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"
             and (not v.is_contiguous() or v.storage_offset())]
    if views:  # strided or offset metadata plans exactly what dense copies plan
        ref = WRAPPERS[kind](WORKSPACE, kv_layout=layout)
        ref.plan(**dense_copy(a))
        assert np.array_equal(np.asarray(w._plan.work.records), np.asarray(ref._plan.work.records)), views
        assert w._plan.max_page == ref._plan.max_page
        stats["views"] += 1
    facts = plan_facts(kind, a, layout)
    assert tuple(w._plan.q_shape) == facts["q_shape"] and w._plan.max_page == facts.get("max_page", -1)
    r = draw_run(rng, kind, facts)
    if r is None:
        return
    kv = (r["k"], r["v"]) if kind == "ragged" else (r["paged_kv_cache"],)
    verdict(lambda: w.run(r["q"], *kv, out=r.get("out"), lse=r.get("lse"), return_lse=r["return_lse"]),
            O.run_violations(kind, facts, r), stats, f"{kind} run", r, valid_raises=NoGPUError)
    stats["runs"] += 1


def _assert_counts(kind: str, stats: Counter) -> None:
    total = stats["valid"] + stats["invalid"]
    print(f"\nfuzz {kind}: {dict(stats)}")
    assert stats["examples"] == EXAMPLES[kind], stats
    assert stats["valid"] >= 0.25 * total and stats["invalid"] >= 0.25 * total, f"one-sided fuzzing: {dict(stats)}"


@pytest.mark.parametrize("kind", ["paged", "decode", "ragged"])
def test_fuzz_plan_and_run(kind):
    stats: Counter = Counter()

    @fuzz(kind)
    def one(case_seed):
        stats["examples"] += 1
        check_plan_and_run(kind, random.Random(case_seed), stats)

    one()
    _assert_counts(kind, stats)
    assert stats["views"] > 0.2 * stats["examples"] and stats["runs"] > 0.05 * stats["examples"], dict(stats)


def test_fuzz_append():
    stats: Counter = Counter()

    @fuzz("append")
    def one(case_seed):
        stats["examples"] += 1
        a = draw_append(random.Random(case_seed))
        verdict(lambda: attnjit.append_paged_kv_cache(**a), O.append_violations(a), stats, "append", a,
                valid_raises=NoGPUError)

    one()
    _assert_counts("append", stats)


def test_fuzz_merge():
    stats: Counter = Counter()
    ops = {"merge_state": attnjit.merge_state, "merge_state_in_place": attnjit.merge_state_in_place,
           "merge_states": attnjit.merge_states}

    @fuzz("merge")
    def one(case_seed):
        stats["examples"] += 1
        op, a = draw_merge(random.Random(case_seed))
        verdict(lambda: ops[op](**a), O.merge_violations(op, a), stats, op, a, valid_raises=NoGPUError)

    one()
    _assert_counts("merge", stats)


def test_the_oracles_limits_are_the_implementations():
    """The oracle restates the documented limits; the implementation must enforce those numbers."""
    from attnjit.ops import planner

    assert planner.LIMITS == {"heads": O.MAX_HEADS, "group": O.MAX_GROUP, "qo_rows": O.MAX_QO_ROWS,
                              "kv_len": O.MAX_KV_LEN, "work_items": O.MAX_WORK_ITEMS}
    assert sum(EXAMPLES.values()) >= 10_000


def test_names_one_matches_whole_argument_names():
    assert names_one("indptr[0] must be 0", {"indptr"})
    assert not names_one("qo_indptr[0] must be 0", {"indptr"})
    assert names_one("run(): q must be", {"q"}) and names_one("q.stride(1)=3", {"q"})
    assert not names_one("request 0's KV length", {"s"})
    assert names_one("(paged_kv_indptr/paged_kv_last_page_len)", {"paged_kv_last_page_len"})
    assert names_one("variant 'head_scale': parameter 'head_scale' must be", {"head_scale"})


def test_a_hang_fails_at_the_deadline():
    """The alarm is what turns a hang into a failure: a call that sleeps past it is stopped, not waited for."""
    import time

    t0 = time.perf_counter()
    with pytest.raises(AssertionError, match=r"hang \(ran over 0.2 s\)"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys.modules[__name__], "DEADLINE_S", 0.2)
            verdict(lambda: time.sleep(5), set(), Counter(), "sleep", {})
    assert time.perf_counter() - t0 < 2
