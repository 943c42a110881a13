"""GPU time of a call, the one way attnjit measures it (``attnjit tune`` and the benchmarks): ``warmup`` calls, then
``blocks`` blocks of ``reps`` back-to-back calls between two CUDA events; the median block's mean, in ms. Calls
queue in the stream one after another, so the host's launch cost hides behind the GPU's work, as long as a call's
GPU work outlasts its host time. Where it may not (a few short kernels a call: cascade decode), ``graph=True``
captures the ``reps`` calls in one CUDA graph and times its replays: the GPU's time alone, as a graph-mode engine
runs it. Calls to be compared with each other go through ``time_many``, which interleaves their blocks."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def time_ms(fn: Callable[[], object], reps: int = 30, blocks: int = 7, warmup: int = 10, *,
            before_block: Callable[[], object] | None = None, graph: bool = False) -> float:
    """Median over blocks of the mean ms per call. ``before_block`` runs ahead of each block, outside the timed
    span (e.g. a barrier that lines up the ranks of a collective). ``graph``: each block replays one CUDA graph of
    ``reps`` calls (``fn`` must be capturable: no synchronization, no host reads of device data)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    block: Callable[[], object]
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()  # the first replay uploads the graph
        torch.cuda.synchronize()
        block = g.replay
    else:
        def block() -> None:
            for _ in range(reps):
                fn()
    means = []
    for _ in range(blocks):
        if before_block is not None:
            before_block()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        block()
        end.record()
        end.synchronize()
        means.append(start.elapsed_time(end) / reps)
    return statistics.median(means)


def time_many(fns: dict[str, Callable[[], object]], reps: int = 30, blocks: int = 7,
              warmup: int = 10, on_block: Callable[[str, float, float, float], None] | None = None) -> dict[str, float]:
    """``time_ms`` of several calls that are to be compared, interleaved: each round times one block of ``reps``
    back-to-back calls of every function in turn (round k starting at the k-th, so no function always follows the
    same one), and each function's figure is the median of its ``blocks`` blocks' means, in ms. Timed one after
    another instead, the later ones run on a GPU that earlier ones heated: on an H100, paged causal 8x2048 measured
    0.487 ms as the first work of a process and 0.632 ms after two seconds of matmuls (benchmarks/harness_ab.py,
    run 134), a larger difference than most comparisons look for. ``on_block(name, t0, t1, ms)``, if given, gets
    each block as it is timed: its wall-clock span (epoch seconds; the GPU is idle when a block starts, so the span is
    the block's) and its mean ms per call (benchmarks/clocks.py joins the spans with the SM clock samples)."""
    import torch

    names = list(fns)
    if not names:
        return {}
    for name in names:
        for _ in range(warmup):
            fns[name]()
    torch.cuda.synchronize()
    means: dict[str, list[float]] = {name: [] for name in names}
    for k in range(blocks):
        for name in names[k % len(names):] + names[:k % len(names)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn = fns[name]
            t0 = time.time()
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            means[name].append(start.elapsed_time(end) / reps)
            if on_block is not None:
                on_block(name, t0, time.time(), means[name][-1])
    return {name: statistics.median(v) for name, v in means.items()}
