"""The GPU's SM clock and power during each timed block of a benchmark run: what a figure was measured at.

bench.py times every call through ``Spans`` (attnjit.timing.time_ms, with each call's wall-clock span and result
kept: ``meta.spans`` of its JSON); sm90_timeline.py keeps a ``span`` beside each row's TFLOP/s. While they run,
scripts/gpu_check.sh samples the GPU every 100 ms into ``clocks.csv``:

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 100

and then joins the two:

    python3 benchmarks/clocks.py bench.json clocks.csv        # one line per timed block: ms, SM MHz, W, C
    python3 benchmarks/clocks.py timeline-1.json clocks.csv

A block's name is the result key whose value is the block's ms (bench.py's rows keep time_ms's return value as it
came); a block of an interleaved timing (time_many) is named by its function's figure, the median the row keeps; a
span no key matches (a sweep's inner timing, a ceiling) is listed by its position. The samples inside a span
are averaged; a span shorter than the sampling period gets the nearest sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Callable


class Spans:
    """``time_ms`` with each call's wall-clock span: ``spans`` is [[t0, t1, ms], ...] in call order (epoch seconds).
    ``interleaved(time_many)`` wraps attnjit.timing.time_many the same way: each of its blocks becomes a span
    [t0, t1, block ms, function name, that function's figure (the median its caller keeps)]."""

    def __init__(self, time_ms: Callable[..., float]):
        self._time_ms = time_ms
        self.spans: list[list[float]] = []

    def __call__(self, *args, **kwargs) -> float:
        t0 = time.time()
        ms = self._time_ms(*args, **kwargs)
        self.spans.append([t0, time.time(), ms])
        return ms

    def interleaved(self, time_many: Callable[..., dict]) -> Callable[..., dict]:
        def timed(fns, **kwargs) -> dict:
            got: list[list] = []
            figures = time_many(fns, on_block=lambda name, t0, t1, ms: got.append([t0, t1, ms, name]), **kwargs)
            self.spans += [span + [figures[span[3]]] for span in got]
            return figures
        return timed


def read_samples(path: Path) -> list[tuple[float, float, float, float]]:
    """(epoch seconds, SM MHz, W, C) per line of nvidia-smi's CSV; lines that do not parse are skipped."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(parts[1]), float(parts[2]), float(parts[3])))
        except ValueError:
            continue
    return out


def during(samples, t0: float, t1: float) -> dict | None:
    """Mean SM MHz / W / C of the samples in [t0, t1] (the nearest one when none falls inside)."""
    if not samples:
        return None
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if not inside:
        mid = (t0 + t1) / 2
        inside = [min(samples, key=lambda s: abs(s[0] - mid))]
    mean = lambda i: round(statistics.mean(s[i] for s in inside))  # noqa: E731
    return {"sm_mhz": mean(1), "watts": mean(2), "celsius": mean(3), "samples": len(inside)}


def _names_by_ms(doc) -> dict[float, str]:
    """ms value -> "section shape key" for every *_ms value in a bench.py document."""
    names: dict[float, str] = {}
    for section, rows in doc.items():
        if not isinstance(rows, list):
            continue
        for r in rows:
            if not isinstance(r, dict):
                continue
            label = " ".join(str(r[k]) for k in ("shape", "feature") if k in r)
            for k, v in r.items():
                if k.endswith("_ms") and isinstance(v, float):
                    names.setdefault(v, f"{section} {label} {k[:-3]}")
    return names


def blocks(doc) -> list[tuple[str, float, float, float]]:
    """(name, t0, t1, ms) of every timed block in a bench.py or sm90_timeline.py document."""
    if isinstance(doc.get("meta"), dict) and "spans" in doc["meta"]:
        names = _names_by_ms(doc)
        out = []
        for i, (t0, t1, ms, *block) in enumerate(doc["meta"]["spans"]):
            if block:   # a block of an interleaved timing: named by its function's figure (the row's value)
                fn, figure = block
                out.append((f"{names.get(figure, f'span {i}')} (block of {fn})", t0, t1, ms))
            else:
                out.append((names.get(ms, f"span {i}"), t0, t1, ms))
        return out
    out = []
    for shape, row in doc.items():   # sm90_timeline.py: {shape: {"tflops": .., "span": [t0, t1]}}
        if isinstance(row, dict) and "span" in row:
            out.append((f"{shape} {row.get('tflops', '')} TFLOP/s", row["span"][0], row["span"][1], float("nan")))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, help="bench.py's or sm90_timeline.py's JSON")
    ap.add_argument("clocks", type=Path, help="nvidia-smi's CSV (timestamp, clocks.sm, power.draw, temperature.gpu)")
    args = ap.parse_args(argv)
    samples = read_samples(args.clocks)
    rows = blocks(json.loads(args.results.read_text()))
    if not rows:
        print(f"clocks.py: no timed spans in {args.results}", file=sys.stderr)
        return 1
    print(f"{len(samples)} samples; SM MHz / W / C averaged over each timed block")
    for name, t0, t1, ms in rows:
        got = during(samples, t0, t1)
        what = "no samples" if got is None else f"{got['sm_mhz']} MHz {got['watts']} W {got['celsius']} C " \
                                                f"({got['samples']})"
        print(f"{name:60s} {ms:9.4f} ms  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
