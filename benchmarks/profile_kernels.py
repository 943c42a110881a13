"""One benchmark shape, attnjit then FlashInfer (when importable), 4 calls each: a target for Nsight Compute.

    python3 benchmarks/profile_kernels.py prefill 32x512     # paged causal prefill, batch x length
    python3 benchmarks/profile_kernels.py decode 1x32768     # decode, batch x KV length
    PROFILE_TILE=q192kv64 python3 benchmarks/profile_kernels.py prefill 8x2048   # an sm90 tile configuration
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
from benchmarks.bench import DT, D, H_KV, H_Q, PS, load_flashinfer, paged_tables  # noqa: E402


def main() -> None:
    op = sys.argv[1] if len(sys.argv) > 1 else "prefill"
    if op not in ("prefill", "decode"):
        raise SystemExit(f"profile_kernels.py: op must be 'prefill' or 'decode', got {op!r}")
    batch, length = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "32x512").split("x"))
    indptr, indices, last, cache = paged_tables(batch, length, seed=1)
    plan_args = (indptr, indices, last, H_Q, H_KV, D, PS)
    if op == "prefill":
        qo_indptr = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device="cuda")
        q = torch.randn(batch * length, H_Q, D, dtype=DT, device="cuda")
        plan_args = (qo_indptr, *plan_args)
        tile = os.environ.get("PROFILE_TILE") or None
        make = {"attnjit": lambda ws: attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, tile=tile)}
        kw = {"causal": True}
    else:
        q = torch.randn(batch, H_Q, D, dtype=DT, device="cuda")
        make = {"attnjit": lambda ws: attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)}
        kw = {}
    fi = load_flashinfer()
    if fi is not None:
        backend = os.environ.get("PROFILE_FI_BACKEND", "fa3")  # the competitor of attnjit's default family
        make["flashinfer"] = (lambda ws: fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)) \
            if op == "prefill" else (lambda ws: fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True))
    for name, new in make.items():
        w = new(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
        w.plan(*plan_args, q_data_type=DT, kv_data_type=DT, **kw)
        for _ in range(4):
            w.run(q, cache)
        torch.cuda.synchronize()
        print(name, op, f"{batch}x{length}", getattr(w, "last_plan", ""))


if __name__ == "__main__":
    main()
