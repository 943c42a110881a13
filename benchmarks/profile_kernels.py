"""Launch one prefill (1x8192 causal) and one decode (1x32768 and 64x4096) run of the benchmark shapes, for ncu:

    ncu --clock-control none -k regex:attnjit_attention --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats ... python3 benchmarks/profile_kernels.py prefill
Each shape runs 4 times (3 warm-ups, then the profiled launch).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attnjit  # noqa: E402
from benchmarks.bench import D, DT, H_KV, H_Q, PS, paged_tables  # noqa: E402

what = sys.argv[1] if len(sys.argv) > 1 else "prefill"
ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
if what == "prefill":
    batch, length = 1, 8192
    indptr, indices, last, cache = paged_tables(batch, length)
    qo = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * length, H_Q, D, dtype=DT, device="cuda")
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws)
    w.plan(qo, indptr, indices, last, H_Q, H_KV, D, PS, causal=True, q_data_type=DT)
else:
    batch, length = (1, 32768) if what == "decode1" else (64, 4096)
    indptr, indices, last, cache = paged_tables(batch, length)
    q = torch.randn(batch, H_Q, D, dtype=DT, device="cuda")
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(indptr, indices, last, H_Q, H_KV, D, PS, q_data_type=DT)
for _ in range(4):
    w.run(q, cache)
torch.cuda.synchronize()
print(what, w.last_plan)
