"""One paged causal prefill shape, attnjit then FlashInfer fa2, a few calls each: a target for Nsight Compute.

    ncu --clock-control none -k regex:'attnjit_attention|Prefill' --launch-skip 2 --launch-count 2 --set full \
        python benchmarks/profile_prefill.py 32x512
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attnjit  # noqa: E402
from bench import DT, D, H_KV, H_Q, PS, load_flashinfer, paged_tables  # noqa: E402


def main() -> None:
    batch, length = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "32x512").split("x"))
    indptr, indices, last, cache = paged_tables(batch, length, seed=1)
    qo_indptr = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * length, H_Q, D, dtype=DT, device="cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws)
    w.plan(qo_indptr, indptr, indices, last, H_Q, H_KV, D, PS, causal=True, q_data_type=DT)
    for _ in range(4):
        w.run(q, cache)
    fi = load_flashinfer()
    if fi is not None:
        fw = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                                    backend="fa2")
        fw.plan(qo_indptr, indptr, indices, last, H_Q, H_KV, D, PS, causal=True, q_data_type=DT, kv_data_type=DT)
        for _ in range(4):
            fw.run(q, cache)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
