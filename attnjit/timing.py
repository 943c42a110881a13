"""GPU time of a call, the one way attnjit measures it (``attnjit tune`` and the benchmarks): ``warmup`` calls, then
``blocks`` blocks of ``reps`` back-to-back calls between two CUDA events; the median block's mean, in ms. Calls
queue in the stream one after another, so the host's launch cost hides behind the GPU's work."""

from __future__ import annotations

import statistics
from typing import Callable


def time_ms(fn: Callable[[], object], reps: int = 30, blocks: int = 7, warmup: int = 10, *,
            before_block: Callable[[], object] | None = None) -> float:
    """Median over blocks of the mean ms per call. ``before_block`` runs ahead of each block, outside the timed
    span (e.g. a barrier that lines up the ranks of a collective)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(blocks):
        if before_block is not None:
            before_block()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        means.append(start.elapsed_time(end) / reps)
    return statistics.median(means)
