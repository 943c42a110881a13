"""Host time of plan() (benchmarks/RESULTS.md, "plan() host time"; issue 13 item 1).

    python3 benchmarks/plan_host.py              # this machine: a CPU workspace where there is no GPU
    python3 benchmarks/plan_host.py --json out.json
    python3 benchmarks/plan_host.py --profile prof.txt   # cProfile of plan() on a few rows, nothing else

The issue's configuration: H_q 32 / H_kv 8 / head_dim 128 / bf16 / page 16 / KV 2048 per request, metadata on
the host as engines pass it (on a GPU host also on the device), decode (one query row per request) and prefill
(128 new tokens per request, causal), batch 1 / 16 / 64 / 256. Per call: the minimum and the median over rounds of
calls (the minimum is the figure to compare on a shared machine; the median shows the noise), attnjit's and
FlashInfer's rounds interleaved so that the host's drift weighs on both. Also:

- where attnjit's plan() spends it (device to host, for device metadata / validate + read metadata / schedule /
  upload / launch setup / the rest), by timing those functions inside plan();
- graph-mode decode: plan() and the fast re-plan (``BatchDecodeWithPagedKVCacheWrapper.fast_plan``) at the same
  sizes, where the wrapper has one;
- the metadata upload alone (``MetadataBuffers.upload``, plain and graph mode; a CPU "device" without a GPU) and, on
  a CPU, merge_state(s)' Python before the launch (stand-in module and launch);
- FlashInfer's plan() with the same arguments where it is installed (the ratio attnjit / FlashInfer is the
  issue's target: <= 0.8).

The JSON says whether attnjit planned with its compiled core (``compiled_scheduler``: attnjit._cplan built, and
ATTNJIT_NATIVE not 0); ``ATTNJIT_NATIVE=0 python3 benchmarks/plan_host.py`` times the Python planner alone.

On a machine without a GPU, plan() skips the upload and the module load (there is nothing to upload to): its figures
are the host work only. The GPU host's figures are the ones the issue's table compares.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import attnjit  # noqa: E402

H_Q, H_KV, D, PS, KV, QO = 32, 8, 128, 16, 2048, 128
DT = torch.bfloat16
BATCHES = (1, 16, 64, 256)


def metadata(batch: int, op: str, device) -> dict:
    pages = KV // PS
    i = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    meta = {"indptr": i([b * pages for b in range(batch + 1)]), "indices": i(list(range(batch * pages))),
            "last": i([PS] * batch)}
    if op == "prefill":
        meta["qo"] = i([b * QO for b in range(batch + 1)])
    return meta


def planner(name: str, op: str, ws, meta: dict):
    """(wrapper, a no-argument function that plans once), for attnjit or FlashInfer."""
    if name == "flashinfer":
        import flashinfer

        mod = flashinfer
    else:
        mod = attnjit
    if op == "decode":
        kw = {"use_tensor_cores": True} if name == "flashinfer" else {}
        w = mod.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **kw)
        return w, lambda: w.plan(meta["indptr"], meta["indices"], meta["last"], H_Q, H_KV, D, PS, q_data_type=DT,
                                 kv_data_type=DT)
    w = mod.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    return w, lambda: w.plan(meta["qo"], meta["indptr"], meta["indices"], meta["last"], H_Q, H_KV, D, PS,
                             causal=True, q_data_type=DT, kv_data_type=DT)


def _round(fn, calls: int, cuda: bool) -> float:
    """us per call of ``calls`` calls back to back (the device idle before and drained after, on a GPU)."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def timed(fn, *, rounds: int = 15, calls: int = 20, cuda: bool = False) -> dict:
    for _ in range(10):
        fn()
    per = [_round(fn, calls, cuda) for _ in range(rounds)]
    return {"min_us": round(min(per), 1), "median_us": round(statistics.median(per), 1)}


def interleaved_stats(fns: dict, *, rounds: int = 15, calls: int = 20, cuda: bool = False) -> dict:
    """``timed``'s figures (min and median us per call) of each function, their rounds interleaved (the order
    rotating each round), so that a slow stretch of a shared host weighs on all of them alike: for ratios and
    differences between them (attnjit's plan() against FlashInfer's, an op against its direct call)."""
    names = list(fns)
    for n in names:
        for _ in range(10):
            fns[n]()
    per: dict = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            per[n].append(_round(fns[n], calls, cuda))
    return {n: {"min_us": round(min(v), 2), "median_us": round(statistics.median(v), 2)} for n, v in per.items()}


def interleaved(fns: dict, *, rounds: int = 15, calls: int = 200, cuda: bool = False) -> dict:
    """The minimum us per call of each function, rounds interleaved (interleaved_stats)."""
    return {n: v["min_us"] for n, v in interleaved_stats(fns, rounds=rounds, calls=calls, cuda=cuda).items()}


@contextmanager
def step_timers(totals: dict):
    """Time the named steps inside attnjit's plan() (each wrapped for the block)."""
    from attnjit.ops import _upload, _wrapper, planner as plan_inputs

    targets = [(_upload.MetadataBuffers, "to_host", "device to host"),
               (plan_inputs, "device_page_range", "device to host"),
               (plan_inputs, "read_paged", "read metadata"), (plan_inputs, "read_ragged", "read metadata"),
               (plan_inputs, "read_qo_indptr", "read metadata"), (plan_inputs, "plan_options", "check scalars"),
               (_wrapper, "plan_work", "schedule"), (_upload.MetadataBuffers, "upload", "upload"),
               (_wrapper._AttentionWrapper, "_fill_launch", "launch setup"),
               (_wrapper, "spec_for", "spec + variant"), (_wrapper._AttentionWrapper, "_bind", "spec + variant")]
    saved = []
    for owner, attr, label in targets:
        fn = getattr(owner, attr)
        saved.append((owner, attr, fn))

        def wrapped(*a, _fn=fn, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_label] = totals.get(_label, 0.0) + time.perf_counter() - t0
        setattr(owner, attr, wrapped)
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def breakdown(fn, calls: int = 300) -> dict:
    totals: dict = {}
    with step_timers(totals):
        for _ in range(20):
            fn()
        totals.clear()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        total = time.perf_counter() - t0
    out = {k: round(v / calls * 1e6, 1) for k, v in sorted(totals.items())}
    out["rest"] = round((total - sum(totals.values())) / calls * 1e6, 1)
    out["total"] = round(total / calls * 1e6, 1)
    return out


def dispatch_overhead(cuda: bool, dev: str) -> dict:
    """Host us of a call through torch.ops.attnjit against the direct call (issue 13: within 2 us). On a GPU: a
    decode run() (batch 16) and merge_state, each both ways. Without one (a kernel cannot run): the dispatcher's own
    cost, an op defined as attnjit's are (torch.library.Library define + impl, tensors in and out) around the same
    Python body, against calling the body."""
    if not cuda:
        lib = torch.library.Library("attnjit_bench", "DEF")
        lib.define("two(int h, Tensor q, Tensor k, Tensor? v, bool b) -> (Tensor, Tensor)")
        body = lambda h, q, k, v, b: (q, k)  # noqa: E731
        lib.impl("two", body, "CPU")
        q = torch.zeros(4)
        op = torch.ops.attnjit_bench.two
        calls = {"python body": lambda: body(1, q, q, None, True),
                 "same body through torch.ops": lambda: op(1, q, q, None, True),
                 "same body through its OpOverload (.default)": lambda: op.default(1, q, q, None, True)}
        return {"op": "dispatch", **interleaved(calls, rounds=9, calls=2000)}
    from attnjit.ops import merge

    gen = torch.Generator().manual_seed(0)
    va, vb = (torch.randn(16, H_Q, D, generator=gen).to(DT).to(dev) for _ in range(2))
    sa, sb = (torch.randn(16, H_Q, generator=gen).to(dev) for _ in range(2))
    meta = metadata(16, "decode", "cpu")
    w, plan = planner("attnjit", "decode", torch.empty(64 << 20, dtype=torch.uint8, device=dev), meta)
    plan()
    q = torch.randn(16, H_Q, D, generator=gen).to(DT).to(dev)
    cache = torch.randn(16 * KV // PS, 2, PS, H_KV, D, dtype=DT, device=dev)
    out = torch.empty_like(q)
    ms, run_out = torch.ops.attnjit.merge_state, torch.ops.attnjit.batch_run_out
    # direct: the public call an eager user makes (merge_state, w.run: each with its gradient guard); body: the
    # eager body alone (what the op runs); torch.ops: the op packet (which resolves the overload per call);
    # .default: the OpOverload, which is what a compiled graph calls. Interleaved rounds: the differences are a few us.
    # the dispatcher's floor on this host: an op of merge_state's schema whose body returns two of its inputs
    lib = torch.library.Library("attnjit_bench_cuda", "DEF")
    lib.define("floor4(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b) -> (Tensor, Tensor)")
    floor_body = lambda a, b, c, d: (a, b)  # noqa: E731
    lib.impl("floor4", floor_body, "CUDA")
    floor_op = torch.ops.attnjit_bench_cuda.floor4.default
    calls = {"floor body": lambda: floor_body(va, sa, vb, sb),
             "floor torch.ops .default": lambda: floor_op(va, sa, vb, sb),
             "merge_state direct": lambda: merge.merge_state(va, sa, vb, sb),
             "merge_state body": lambda: merge.merge_state_eager(va, sa, vb, sb),
             "merge_state torch.ops": lambda: ms(va, sa, vb, sb),
             "merge_state torch.ops .default": lambda: ms.default(va, sa, vb, sb),
             "decode run direct": lambda: w.run(q, cache, out=out),
             "decode run torch.ops": lambda: run_out(w._handle, q, cache, None, out, None),
             "decode run torch.ops .default": lambda: run_out.default(w._handle, q, cache, None, out, None)}
    res = interleaved(calls, cuda=True, rounds=15, calls=200)
    for what in ("merge_state", "decode run"):
        res[f"{what}: .default - direct"] = round(res[f"{what} torch.ops .default"] - res[f"{what} direct"], 2)
    res["merge_state: .default - body"] = round(res["merge_state torch.ops .default"] - res["merge_state body"], 2)
    res["dispatcher floor: .default - body"] = round(res["floor torch.ops .default"] - res["floor body"], 2)
    return {"op": "dispatch", **res}


def upload_rows(dev: str) -> list[dict]:
    """The metadata upload alone (``MetadataBuffers.upload``) for the decode plans above, plain and graph mode. On a
    machine without a GPU it runs with a CPU "device" (the code a GPU plan runs, minus pinned memory and the
    driver's copy): its figure is the Python of the upload only."""
    from attnjit.ops._upload import MetadataBuffers

    rows = []
    device = torch.device(dev)
    for batch in (1, 256):
        meta = metadata(batch, "decode", "cpu")
        w, fn = planner("attnjit", "decode", torch.empty(64 << 20, dtype=torch.uint8, device=dev), meta)
        fn()
        work, used = w._plan.work, int(meta["indptr"][-1])
        row = {"op": "upload", "batch": batch}
        for graph in (False, True):
            buffers = MetadataBuffers(device, graph, None)

            def up(buffers=buffers):
                buffers.upload(work.records, num_groups=work.num_groups, num_kv_heads=H_KV, page_ids=meta["indices"],
                               used=used, keep=[])
            row["graph" if graph else "plain"] = timed(up, cuda=dev == "cuda")["min_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def readback_rows() -> dict:
    """GPU only: what reading device metadata back costs, piece by piece (us a call, minimum): the decode B = 1 and
    B = 256 tables (indptr, last_page_len, page ids) through planner.to_host (torch.cat, then .cpu()) and through
    MetadataBuffers.to_host (RawCuda copies into a pinned buffer, neighbours in one allocation as one copy, one
    stream synchronize; also with each tensor in its own 8 MB allocation); one 2-int .cpu(); one
    RawCuda 8-byte copy back with its synchronize; a synchronize alone, RawCuda's and torch's."""
    from attnjit.ops import planner as plan_inputs
    from attnjit.ops._upload import MetadataBuffers

    meta_buf = MetadataBuffers(torch.device("cuda", torch.cuda.current_device()), False, None)
    raw = meta_buf.raw
    row = {"op": "read back"}
    for batch in (1, 256):
        m = metadata(batch, "decode", "cuda")
        args = (m["indptr"], m["last"], m["indices"])
        row[f"planner.to_host B{batch}"] = timed(lambda: plan_inputs.to_host(*args), cuda=True)["min_us"]
        if raw is not None:
            row[f"MetadataBuffers.to_host B{batch}"] = timed(lambda: meta_buf.to_host(*args), cuda=True)["min_us"]
            # the prefill read-back (qo_indptr too): one copy a tensor, against one torch.cat and one copy
            pre = (m["indptr"].clone(),) + args
            row[f"MetadataBuffers.to_host prefill B{batch}"] = timed(lambda: meta_buf.to_host(*pre),
                                                                     cuda=True)["min_us"]
            calls = []
            real_copy, raw.copy_back = raw.copy_back, lambda *a: (calls.append(a), real_copy(*a))
            meta_buf.to_host(*pre)
            del raw.copy_back   # the class's method again
            row[f"MetadataBuffers.to_host prefill B{batch}: copies"] = len(calls)   # neighbours share one
            # the same tensors in their own allocations (nothing to join): one copy each
            apart = [torch.empty(2 << 20, dtype=torch.int32, device="cuda") for _ in pre]
            sep = tuple(a[:t.numel()].copy_(t) for a, t in zip(apart, pre))
            row[f"MetadataBuffers.to_host prefill B{batch}, apart"] = timed(lambda: meta_buf.to_host(*sep),
                                                                            cuda=True)["min_us"]
            back = torch.empty(sum(t.numel() for t in pre), dtype=torch.int32, pin_memory=True)

            def cat_back():
                flat = torch.cat([t.reshape(-1) for t in pre])
                stream = raw.stream()
                raw.copy_back(back.data_ptr(), flat.data_ptr(), 4 * flat.numel(), stream)
                raw.sync(stream)
            row[f"torch.cat + one copy back prefill B{batch}"] = timed(cat_back, cuda=True)["min_us"]
    two = torch.zeros(2, dtype=torch.int32, device="cuda")
    row["one .cpu() of 2 ints"] = timed(lambda: two.cpu(), cuda=True)["min_us"]
    row["torch stream synchronize"] = timed(lambda: torch.cuda.current_stream().synchronize(), cuda=True)["min_us"]
    if raw is not None:
        pinned = torch.zeros(2, dtype=torch.int32, pin_memory=True)

        def back():
            stream = raw.stream()
            raw.copy_back(pinned.data_ptr(), two.data_ptr(), 8, stream)
            raw.sync(stream)
        row["RawCuda 8-byte copy back + synchronize"] = timed(back, cuda=True)["min_us"]
        row["RawCuda synchronize alone"] = timed(lambda: raw.sync(raw.stream()), cuda=True)["min_us"]
    print(json.dumps(row), flush=True)
    return row


def merge_rows() -> dict:
    """Host us of the eager merge_state / merge_states / merge_state_in_place Python before their launch, on the
    CPU: [16, 32, 128] bf16 states; the GPU check, the module (its lookup is still made) and the launch are
    stand-ins that do nothing but pack the parameter struct (on a GPU host dispatch_overhead times the real call)."""
    from attnjit.ops import merge

    gen = torch.Generator().manual_seed(0)
    va, vb = (torch.randn(16, H_Q, D, generator=gen).to(DT) for _ in range(2))
    sa, sb = (torch.randn(16, H_Q, generator=gen) for _ in range(2))
    vm, sm = torch.randn(16, 2, H_Q, D, generator=gen).to(DT), torch.randn(16, 2, H_Q, generator=gen)
    from attnjit import dispatch
    from attnjit.generator import PARAMS

    class FakeLaunch:  # packs the struct as a Launch does, launches nothing
        def __init__(self, op, kernel, grid):
            self.grid, self.struct = grid, kernel

        def __call__(self, values):
            self.struct.pack(*values)

    class FakeModule:
        key, device_index = "stand-in", 0
        kernels = {"attnjit_merge_state": PARAMS["merge_two"].struct,
                   "attnjit_merge_states": PARAMS["merge_many"].struct}

    saved = merge.require_cuda, dispatch.module, dispatch.device_arch, dispatch.Launch
    merge.require_cuda = lambda *a: None
    dispatch.module, dispatch.device_arch, dispatch.Launch = (lambda *a: FakeModule), (lambda d: "sm_90a"), FakeLaunch
    dispatch.clear_memory()
    try:
        calls = {"merge_state": lambda: merge.merge_state_eager(va, sa, vb, sb),
                 "merge_state_in_place": lambda: merge.merge_state_in_place_eager(va, sa, vb, sb),
                 "merge_states": lambda: merge.merge_states_eager(vm, sm)}
        row = {"op": "merge (python before the launch)",
               **{n: timed(f, rounds=9, calls=500)["min_us"] for n, f in calls.items()}}
    finally:
        merge.require_cuda, dispatch.module, dispatch.device_arch, dispatch.Launch = saved
        dispatch.clear_memory()
    print(json.dumps(row), flush=True)
    return row


def _profiled(fn, calls: int) -> str:
    """cProfile of ``calls`` calls of fn: each function's own time, the top 30."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def profiles(path: Path, dev: str, calls: int = 400) -> None:
    """cProfile of attnjit's plan() on a few rows and of fast_plan() at batch 256, written to ``path``: what the step
    timers' "rest" is made of on this host."""
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    cases = [("decode", 1, "cpu"), ("prefill", 1, "cpu"), ("decode", 256, "cpu"), ("prefill", 1, dev),
             ("decode", 256, dev)]
    with path.open("w") as f:
        for op, batch, where in cases:
            fn = planner("attnjit", op, ws, metadata(batch, op, where))[1]
            for _ in range(20):
                fn()
            f.write(f"==== {op} batch {batch} metadata on {where}: {calls} calls\n{_profiled(fn, calls)}\n")
        w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True)
        meta = metadata(256, "decode", "cpu")
        w.plan(meta["indptr"], meta["indices"], meta["last"], H_Q, H_KV, D, PS, q_data_type=DT)
        fast = lambda: w.fast_plan(meta["indptr"], meta["indices"], meta["last"])  # noqa: E731
        f.write(f"==== fast_plan batch 256: {calls} calls\n{_profiled(fast, calls)}\n")


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--profile", type=Path, help="write cProfile tables of plan() here, then stop")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if args.profile:
        profiles(args.profile, dev)
        return {}
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    try:
        import flashinfer  # noqa: F401
        names = ("attnjit", "flashinfer") if cuda else ("attnjit",)
    except ImportError:
        names = ("attnjit",)
    wheres = ("host", "device") if cuda else ("host",)
    workspaces = {"attnjit": ws}
    if "flashinfer" in names:
        workspaces["flashinfer"] = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    rows = []
    for op in ("decode", "prefill"):
        for batch in BATCHES:
            for where in wheres:
                meta = metadata(batch, op, "cpu" if where == "host" else dev)
                row = {"op": op, "batch": batch, "metadata": where}
                # attnjit's and FlashInfer's rounds interleaved: the ratio is the figure, and this host drifts
                row.update(interleaved_stats({name: planner(name, op, workspaces[name], meta)[1] for name in names},
                                             cuda=cuda))
                if "flashinfer" in row:
                    row["ratio_min"] = round(row["attnjit"]["min_us"] / row["flashinfer"]["min_us"], 2)
                if not args.no_breakdown:
                    row["attnjit_steps"] = breakdown(planner("attnjit", op, ws, meta)[1])
                rows.append(row)
                print(json.dumps(row), flush=True)
    fast = []
    for batch in BATCHES:
        meta = metadata(batch, "decode", "cpu")
        w = attnjit.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=dev),
                                                       "NHD", use_cuda_graph=True)
        plan = lambda: w.plan(meta["indptr"], meta["indices"], meta["last"], H_Q, H_KV, D, PS,  # noqa: E731
                              q_data_type=DT)
        plan()
        row = {"op": "decode-graph", "batch": batch, "plan": timed(plan, cuda=cuda)}
        if hasattr(w, "fast_plan"):
            try:   # (run 98: a pinned allocation failed here once, "CUDA error: out of memory"; the rows after it
                # still say what they measure, and the error is in the row)
                row["fast_plan"] = timed(lambda: w.fast_plan(meta["indptr"], meta["indices"], meta["last"]),
                                         cuda=cuda)
            except RuntimeError as e:
                row["fast_plan_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
                print(f"plan_host.py: fast_plan B{batch}: {row['fast_plan_error']}", file=sys.stderr)
        fast.append(row)
        print(json.dumps(row), flush=True)
    uploads = upload_rows(dev)
    readback = readback_rows() if cuda else None
    merges = None if cuda else merge_rows()
    dispatch = dispatch_overhead(cuda, dev)
    print(json.dumps(dispatch), flush=True)
    from attnjit import knobs
    from attnjit.ops import scheduler

    out = {"device": torch.cuda.get_device_name() if cuda else "cpu (no GPU: no upload, no module load)",
           "compiled_scheduler": scheduler._cplan is not None and knobs.NATIVE.get(),
           "config": {"H_q": H_Q, "H_kv": H_KV, "head_dim": D, "page_size": PS, "kv_per_request": KV,
                      "prefill_qo_per_request": QO, "dtype": "bf16"}, "rows": rows, "graph_decode": fast,
           "upload": uploads, "read_back": readback, "merge": merges, "dispatch": dispatch}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
