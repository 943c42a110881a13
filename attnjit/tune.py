"""``attnjit tune``: time each named tile configuration of a spec's kernel family on this GPU and write the winner
to a tuning record (attnjit/tuning.py), which plan() then uses. Needs a GPU; compiles each configuration once.

The workload is a batch of ``batch x length`` requests (the spec's page size, layout and mask; 8 KV heads and the
spec's group of query heads), random inputs, every configuration timed with CUDA events around back-to-back runs
(median of blocks). Configurations must agree with each other (they compute the same attention): a disagreement
beyond bf16/fp16 rounding is an error, not a winner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import dispatch, dtypes, families
from .cache import Cache
from .errors import NoGPUError
from .specs import AttentionSpec
from .timing import time_many
from .tuning import Record, TuningStore, gpu_id, untuned

KV_HEADS = 8


@dataclass(frozen=True)
class Outcome:
    spec: AttentionSpec
    ms: dict[str, float]      # tile name -> median ms
    best: str | None          # None: nothing to tune
    note: str = ""


def _workload(torch, spec: AttentionSpec, batch: int, length: int):
    """The workload's inputs, made once, and a function that plans a wrapper on them with one tile configuration:
    tile -> (wrapper, run(out)); and q (its outputs' shape)."""
    import attnjit

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    dt = dtypes.of(spec.dtype_q).torch
    d, hq = spec.head_dim_qk, KV_HEADS * spec.group_size
    q = torch.randn(batch * length, hq, d, dtype=dt, device=dev, generator=gen)
    qo = torch.arange(0, batch * length + 1, length, dtype=torch.int32)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)   # shared: the runs are stream-ordered
    causal = spec.mask == "causal"
    if spec.kv == "ragged":
        k, v = (torch.randn(batch * length, KV_HEADS, d, dtype=dt, device=dev, generator=gen) for _ in range(2))

        def planned(tile: str | None):
            w = attnjit.BatchPrefillWithRaggedKVCacheWrapper(ws, backend=spec.family, variant=spec.variant, tile=tile)
            w.plan(qo, qo, hq, KV_HEADS, d, causal=causal, q_data_type=dt)
            return w, lambda out: w.run(q, k, v, out=out)
        return planned, q
    ps = spec.page_size
    pages = -(-length // ps)
    ids = torch.randperm(batch * pages, device=dev, generator=gen).to(torch.int32)
    indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32)
    last = torch.full((batch,), length - ps * (pages - 1), dtype=torch.int32)
    shape = (batch * pages, 2, ps, KV_HEADS, d) if spec.layout == "NHD" else (batch * pages, 2, KV_HEADS, ps, d)
    cache = torch.randn(shape, dtype=dt, device=dev, generator=gen)

    def planned(tile: str | None):   # a family name is a backend name
        w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, spec.layout, backend=spec.family, variant=spec.variant,
                                                        tile=tile)
        w.plan(qo, indptr, ids.cpu(), last, hq, KV_HEADS, d, ps, causal=causal, q_data_type=dt)
        return w, lambda out: w.run(q, cache, out=out)
    return planned, q


def tune(spec: AttentionSpec, *, batch: int, length: int, reps: int = 20, cache: Cache | None = None,
         say: Callable[[str], None] = lambda _s: None) -> Outcome:
    """Time every tile configuration of ``spec`` (a prefill spec) and record the fastest for this GPU."""
    import torch

    if not torch.cuda.is_available():
        raise NoGPUError("attnjit tune times kernels: it needs a CUDA GPU (none is available)")
    spec = untuned(spec)
    names = families.tunable_names(spec)
    if spec.op != "prefill" or len(names) < 2:
        return Outcome(spec, {}, None, f"nothing to tune: the {spec.family} family picks its tiles per batch"
                       if spec.op == "prefill" else "nothing to tune: only prefill specs have tile configurations")
    if spec.variant is not None and any(part.params for part in spec.variant.parts):
        return Outcome(spec, {}, None, f"not tuned: variant {spec.variant.name!r} takes run-time parameters")
    planned, q = _workload(torch, spec, batch, length)
    runs, outs = {}, {}
    for i, name in enumerate(names, 1):   # a tile not in the cache compiles here (a minute or more each): say so
        say(f"  {spec.short_name()}: planning tile {name} ({i}/{len(names)}; compiles it unless it is cached)")
        w, run = planned(name)
        if w.last_plan.get("tile") is None:
            raise RuntimeError(f"tune: the plan of {spec.short_name()} reports no tile")
        out = outs[name] = torch.empty_like(q)
        runs[name] = (lambda run, out: lambda: run(out))(run, out)
    # interleaved (timing.time_many): a tile timed late would otherwise run on a GPU the earlier ones heated
    say(f"  {spec.short_name()}: timing {len(names)} tile configurations, interleaved")
    ms = time_many(runs, reps=reps, blocks=5, warmup=3)
    ref = outs[names[0]].float()
    for name in names:
        err = ((outs[name].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if not err < 2e-2:
            raise RuntimeError(f"tune: tile {name} of {spec.short_name()} disagrees with {names[0]} (relative "
                               f"difference {err:.2e}); not recording a winner")
        say(f"  {spec.short_name()} tile {name}: {ms[name]:.4f} ms")
    best = min(ms, key=ms.get)
    device = torch.cuda.get_device_name()
    sms = dispatch.num_sms(q.device)  # the SM count plan() reads the record with
    record = Record(spec=spec.canonical(), gpu=gpu_id(spec.arch, sms), tile=best, ms=ms, device=device,
                    workload=f"prefill {batch}x{length}, {KV_HEADS * spec.group_size} query / {KV_HEADS} KV heads")
    TuningStore(cache).write(record)
    return Outcome(spec, ms, best)
