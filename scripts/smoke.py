"""A quick check of each kernel family on a few batches against the float64 reference, run before the GPU suite
(scripts/gpu_check.sh smoke): one line per (case, family) with the relative error, the lse error and the time; a
hang is caught by the caller's `timeout`, so a broken kernel costs seconds, not the whole GPU call.

    python3 scripts/smoke.py [fa2,sm90]
    python3 scripts/smoke.py sm90:q192kv64       # a family with one of its tile configurations (16-bit cases)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attnjit  # noqa: E402
from attnjit import reference  # noqa: E402
from tests.helpers import REL_TOL, i32, make_paged, make_ragged, poisoned  # noqa: E402

DEV = "cuda"
BACKEND = {"fa2": "fa2", "sm90": "fa3"}
# (name, kind, qo_lens, kv_lens, head_dim, page_size, causal, dtype, split)
CASES = [
    ("seed-p4", "paged", (3, 1, 4), (6, 2, 9), 128, 4, True, torch.float16, {}),
    ("mixed", "paged", (17, 1, 0, 64, 1, 33, 2, 1, 0), (40, 1, 5, 64, 300, 1000, 2, 129, 0), 128, 16, True,
     torch.bfloat16, {}),
    ("prefill-only", "paged", (200, 129), (200, 700), 128, 16, True, torch.bfloat16, {}),
    ("noncausal-p1", "paged", (200, 129), (200, 700), 128, 1, False, torch.bfloat16, {}),
    ("split", "paged", (100, 1), (3000, 5000), 128, 16, True, torch.bfloat16, {"fixed_split_size": 128}),
    ("ragged-d64", "ragged", (200, 129), (200, 700), 64, 0, True, torch.bfloat16, {}),
    ("ragged-d256", "ragged", (200, 129), (200, 700), 256, 0, True, torch.float16, {}),
]


def run(case, family: str, tile: str | None = None) -> tuple[float, float, float]:
    name, kind, qo, kv, d, ps, causal, dtype, split = case
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    opts = {"backend": BACKEND[family], "tile": tile}
    if kind == "ragged":
        qo_indptr, kv_indptr, q, k, v = make_ragged(qo, kv, num_qo_heads=32, num_kv_heads=8, head_dim=d, dtype=dtype,
                                                    device=DEV, seed=3)
        w = attnjit.BatchPrefillWithRaggedKVCacheWrapper(ws, **opts)
        w.plan(i32(qo_indptr, DEV), i32(kv_indptr, DEV), 32, 8, d, causal=causal, q_data_type=dtype, **split)
        out, lse = poisoned(q.shape, dtype, DEV), poisoned(q.shape[:2], torch.float32, DEV)
        t0 = time.perf_counter()
        w.run(q, k, v, out=out, lse=lse)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        ref_o, ref_lse = reference.batch_ragged(q, k, v, qo_indptr, kv_indptr, causal=causal)
    else:
        b = make_paged(qo, kv, page_size=ps, num_qo_heads=32, num_kv_heads=8, head_dim=d, dtype=dtype, device=DEV,
                       seed=3)
        w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, **opts)
        w.plan(*b.tensors(DEV), 32, 8, d, ps, causal=causal, q_data_type=dtype, **split)
        out, lse = poisoned(b.q.shape, dtype, DEV), poisoned(b.q.shape[:2], torch.float32, DEV)
        t0 = time.perf_counter()
        w.run(b.q, b.cache, out=out, lse=lse)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        ref_o, ref_lse = reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                               page_size=ps, causal=causal)
    assert w.last_plan["family"] == family, w.last_plan
    assert tile is None or w._plan.spec.tile == tile, (w._plan.spec, tile)  # the configuration asked for ran
    o64, ref = out.double(), ref_o.to(DEV).double()
    rel = ((o64 - ref).norm() / ref.norm()).item() if torch.isfinite(o64).all() else float("nan")
    fin = torch.isfinite(ref_lse.to(DEV))
    lse_err = (lse.double()[fin] - ref_lse.to(DEV).double()[fin]).abs().max().item() if fin.any() else 0.0
    return rel, lse_err, ms


def main() -> int:
    families = (sys.argv[1] if len(sys.argv) > 1 else "fa2,sm90").split(",")
    bad = 0
    for entry in families:
        family, _, tile = entry.partition(":")
        for case in CASES:
            if tile and case[4] > 128:  # the tile configurations beyond the default stop at head_dim 128
                continue
            try:
                rel, lse_err, ms = run(case, family, tile or None)
                ok = rel < REL_TOL[case[7]] and lse_err < 5e-2
                bad += not ok
                print(f"smoke {entry:5s} {case[0]:14s} rel {rel:.2e} lse {lse_err:.2e} {ms:8.2f} ms "
                      f"{'ok' if ok else 'WRONG'}", flush=True)
            except Exception as exc:  # noqa: BLE001 (report and go on: this is a diagnostic)
                bad += 1
                print(f"smoke {entry:5s} {case[0]:14s} ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
