"""attnjit.timing.time_many on the CPU: CUDA events and synchronize stood in for, so the order of the blocks and the
medians can be checked without a GPU."""

from __future__ import annotations

import torch

from attnjit import timing


class _Clock:
    """A fake stream clock: each call of a timed function advances it by that function's cost."""

    def __init__(self):
        self.now = 0.0

    def event(self, enable_timing=False):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return other.t - self.t
        return Event()


def test_time_many_interleaves_blocks_and_takes_each_median(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    order: list[str] = []
    heat = {"n": 0}

    def make(name, cost):
        def fn():
            order.append(name)
            heat["n"] += 1
            clock.now += cost * (1 + heat["n"] / 1000)   # the GPU slows as it works: drift over the run
        return fn

    fns = {"a": make("a", 1.0), "b": make("b", 2.0), "c": make("c", 3.0)}
    got = timing.time_many(fns, reps=4, blocks=5, warmup=2)
    assert order[:6] == ["a", "a", "b", "b", "c", "c"]            # the warm-ups, each function in turn
    blocks = [order[i] for i in range(6, len(order), 4)]          # the first call of each timed block
    assert blocks == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c", "b", "c", "a"]
    assert all(order[i:i + 4] == [order[i]] * 4 for i in range(6, len(order), 4))   # a block is one function
    assert set(got) == {"a", "b", "c"}
    # the drift weighs on each alike: the ratios stay near the costs' (1 : 2 : 3) within the drift's few percent
    assert abs(got["b"] / got["a"] - 2.0) < 0.02 and abs(got["c"] / got["a"] - 3.0) < 0.03
    assert timing.time_many({}) == {}


def test_time_many_reports_each_block_with_its_span_and_mean(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)

    def make(cost):
        def fn():
            clock.now += cost
        return fn

    seen = []
    got = timing.time_many({"a": make(1.0), "b": make(2.0)}, reps=3, blocks=4, warmup=1,
                           on_block=lambda *block: seen.append(block))
    assert [s[0] for s in seen] == ["a", "b", "b", "a", "a", "b", "b", "a"]   # every block, in the order timed
    assert all(t0 <= t1 for _, t0, t1, _ in seen)
    assert [ms for name, _, _, ms in seen if name == "b"] == [2.0] * 4
    assert got == {"a": 1.0, "b": 2.0}
