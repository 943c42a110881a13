"""The read-back's copy grouping (ops/_readback.copy_runs): device metadata lying close together in one allocation
comes back as one copy, and no copy ever spans bytes outside the allocation the driver reports (the GPU test
test_read_back_of_device_metadata_matches_planner_to_host runs it against the real driver)."""

import random

import pytest

from attnjit.ops import _readback
from attnjit.ops._readback import copy_runs


def table(*allocs):
    """allocation() over [(base, size), ...]."""
    def allocation(ptr):
        for base, size in allocs:
            if base <= ptr < base + size:
                return base, size
        return None
    return allocation


def test_adjacent_tensors_of_one_allocation_share_a_copy():
    alloc = table((0x1000, 1 << 21))
    spans = [(0x1000 + 1024, 0x1000 + 1028), (0x1000, 0x1000 + 8), (0x1000 + 512, 0x1000 + 600)]
    assert copy_runs(spans, alloc) == [(0x1000, 0x1000 + 1028, [1, 2, 0])]


def test_spans_apart_in_other_allocations_or_unknown_memory_are_copied_alone():
    alloc = table((0x10000, 0x1000), (0x11000, 0x1000))   # two allocations side by side
    spans = [(0x10f00, 0x10f10), (0x11000, 0x11010)]      # 0xf0 bytes apart, but across the boundary
    assert copy_runs(spans, alloc) == [(0x10f00, 0x10f10, [0]), (0x11000, 0x11010, [1])]
    assert copy_runs(spans, table()) == [(0x10f00, 0x10f10, [0]), (0x11000, 0x11010, [1])]  # driver: unknown
    assert len(copy_runs(spans, None)) == 2                                                  # no driver


def test_a_gap_wider_than_the_limit_or_an_unaligned_tensor_is_its_own_copy():
    alloc = table((0, 1 << 30))
    far = [(0, 16), (16 + _readback.GAP + 4, 16 + _readback.GAP + 8)]
    assert len(copy_runs(far, alloc)) == 2
    assert len(copy_runs([(0, 16), (16 + _readback.GAP, 16 + _readback.GAP + 4)], alloc)) == 1
    assert len(copy_runs([(0, 16), (18, 22), (24, 28)], alloc)) == 3   # 18 is not 4-byte aligned: nothing joins it
    assert copy_runs([(0, 16), (8, 12), (4, 32)], alloc) == [(0, 32, [0, 2, 1])]   # overlapping views


def test_the_allocation_is_asked_once_per_copy():
    asked = []

    def alloc(ptr):
        asked.append(ptr)
        return (0, 1 << 20)
    copy_runs([(4096 * i, 4096 * i + 64) for i in range(10)], alloc)
    assert asked == [0]


def test_empty_spans_are_refused():
    with pytest.raises(ValueError, match="empty span"):
        copy_runs([(16, 16)], table((0, 64)))


def test_random_layouts_cover_every_span_once_and_stay_inside_their_allocation():
    rng = random.Random(7)
    for _ in range(2000):
        allocs, at = [], 0
        for _ in range(rng.randint(1, 4)):
            at += rng.choice([0, 4096])
            size = rng.choice([512, 4096, 1 << 16, 1 << 21])
            allocs.append((at, size))
            at += size
        alloc = table(*allocs)
        spans = []
        for _ in range(rng.randint(1, 6)):
            base, size = rng.choice(allocs)
            start = base + rng.randrange(0, size, rng.choice([1, 4, 512]))
            n = rng.randint(1, 64)
            spans.append((start, min(start + 4 * n, base + size) if start + 4 <= base + size else start + 4))
        spans = [(s, e) for s, e in spans if e > s]
        if not spans:
            continue
        runs = copy_runs(spans, alloc, gap=rng.choice([0, 256, _readback.GAP]))
        covered = sorted(m for _, _, members in runs for m in members)
        assert covered == list(range(len(spans)))
        for s, e, members in runs:
            for m in members:
                assert s <= spans[m][0] and spans[m][1] <= e
            if len(members) > 1:
                found = alloc(s)
                assert found is not None and s % 4 == 0 and e <= found[0] + found[1], (s, e, allocs)
                assert all(spans[m][0] % 4 == 0 for m in members)
            else:
                assert (s, e) == spans[members[0]]


def test_the_gap_stays_below_a_mapping_granule():
    """The second safety argument (module docstring): a joined span's gaps are shorter than the 2 MB granules that
    torch's expandable segments map, so a span never holds a whole unmapped granule."""
    assert 0 < _readback.GAP < (2 << 20)


def test_readback_plan_gives_every_device_tensor_its_view():
    """MetadataBuffers._readback_plan (no GPU needed once its buffer exists): joined tensors' views sit at their
    offsets within their copy, an empty device tensor gets an empty view, a host tensor none; the copies' host
    destinations follow one another in the buffer."""
    import torch

    from attnjit.ops._upload import MetadataBuffers

    class Raw:   # the allocation query RawCuda makes: one allocation of 1 MB at 0x10000
        @staticmethod
        def allocation(ptr):
            return (0x10000, 1 << 20) if 0x10000 <= ptr < 0x10000 + (1 << 20) else None

    meta = MetadataBuffers(torch.device("cpu"), False, None)
    meta.raw = Raw()
    meta._readback = buf = torch.arange(4096, dtype=torch.int32)
    key = ((0x10000 + 512, 3), None, (0x10000, 2), (0x10000 + 4, 0), (0x900000, 5))
    copies, views = meta._readback_plan(key)
    base = buf.data_ptr()
    assert copies == [(base, 0x10000, 0x10000 + 524, True), (base + 524, 0x900000, 0x900000 + 20, False)]
    assert views[1] is None and views[3].numel() == 0
    assert views[2].tolist() == [0, 1] and views[0].tolist() == [128, 129, 130] and views[4].tolist() == list(
        range(131, 136))
