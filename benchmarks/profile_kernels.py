"""One benchmark shape, attnjit then FlashInfer (when importable), 4 calls each: a target for Nsight Compute.

    python3 benchmarks/profile_kernels.py prefill 32x512     # paged causal prefill, batch x length
    python3 benchmarks/profile_kernels.py decode 1x32768     # decode, batch x KV length
    python3 benchmarks/profile_kernels.py prefix 16x8192     # a cascade's level 0: 16 query rows over 8192 keys
    PROFILE_TILE=q192kv64 python3 benchmarks/profile_kernels.py prefill 8x2048   # an sm90 tile configuration
    PROFILE_KV=e4m3 python3 benchmarks/profile_kernels.py decode 32x16384        # an fp8 cache (benchmarks/fp8.py's)
    ncu --clock-control none -k regex:"attnjit_(attention|sm90)" --launch-skip 2 --launch-count 1 --set full \\
        python3 benchmarks/profile_kernels.py prefill 32x512
`bash scripts/gpu_check.sh profile` runs it under ncu for both libraries and summarizes the stalls.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attnjit  # noqa: E402
from benchmarks import fp8  # noqa: E402
from benchmarks.bench import DT, D, H_KV, H_Q, PS, load_flashinfer, paged_tables  # noqa: E402


def _deferred_prefill(ws):
    """The cascade's level 0 as plan() makes it there: a deferred-merge plan (scheduler.defer_merges)."""
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws)
    w._defer_merge = True
    return w


def main() -> None:
    op = sys.argv[1] if len(sys.argv) > 1 else "prefill"
    if op not in ("prefill", "decode", "prefix"):
        raise SystemExit(f"profile_kernels.py: op must be 'prefill', 'decode' or 'prefix', got {op!r}")
    batch, length = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "32x512").split("x"))
    indptr, indices, last, cache = paged_tables(1 if op == "prefix" else batch, length, seed=1)
    plan_args = (indptr, indices, last, H_Q, H_KV, D, PS)
    run_kw: dict = {}
    kv_dtype, scales = DT, {}
    kv = os.environ.get("PROFILE_KV", "bf16")
    if kv != "bf16":
        if kv not in ("e4m3", "e5m2"):
            raise SystemExit(f"profile_kernels.py: PROFILE_KV must be bf16, e4m3 or e5m2, got {kv!r}")
        kv_dtype = torch.float8_e4m3fn if kv == "e4m3" else torch.float8_e5m2
        cache, scales = fp8.quantized(cache, kv_dtype), fp8.SCALES
    if op == "prefill":
        qo_indptr = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device="cuda")
        q = torch.randn(batch * length, H_Q, D, dtype=DT, device="cuda")
        plan_args = (qo_indptr, *plan_args)
        tile = os.environ.get("PROFILE_TILE") or None
        make = {"attnjit": lambda ws: attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, tile=tile)}
        kw = {"causal": True}
    elif op == "prefix":   # `batch` query rows over one group of `length` keys, non-causal (benchmarks/cascade.py)
        q = torch.randn(batch, H_Q, D, dtype=DT, device="cuda")
        plan_args = (torch.tensor([0, batch], dtype=torch.int32, device="cuda"), *plan_args)
        make = {"attnjit": _deferred_prefill}
        kw = {}
        run_kw = {"out": torch.zeros_like(q), "lse": torch.full(q.shape[:2], float("-inf"), device="cuda")}
    else:
        q = torch.randn(batch, H_Q, D, dtype=DT, device="cuda")
        make = {"attnjit": lambda ws: attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)}
        kw = {}
    fi = load_flashinfer()
    if fi is not None:
        backend = os.environ.get("PROFILE_FI_BACKEND", "fa3")  # the competitor of attnjit's default family
        make["flashinfer"] = (lambda ws: fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)) \
            if op != "decode" else (lambda ws: fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True))
    for name, new in make.items():
        w = new(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
        w.plan(*plan_args, q_data_type=DT, kv_data_type=kv_dtype, **kw)
        for _ in range(4):
            w.run(q, cache, **scales, **(run_kw if name == "attnjit" else {}))
        torch.cuda.synchronize()
        print(name, op, f"{batch}x{length}", getattr(w, "last_plan", ""))


if __name__ == "__main__":
    main()
