"""benchmarks/prefill.py's row and variant loops on the CPU: the implementations stood in for, so what reaches the
timer (each one, once, with its own output) and what lands in the rows can be checked without a GPU."""

from __future__ import annotations

import types

import torch

from benchmarks import prefill


def _stand_ins(monkeypatch, calls):
    def inputs(row, seed):
        q = torch.zeros(4, 2, 8)
        return q, None, None, None

    def attnjit(ws, row, q, qo, kv, tables, backend, **kw):
        w = types.SimpleNamespace(last_plan={"tile": backend, "family": "sm90"})

        def run(out, **run_kw):
            calls.append(("attnjit", backend))
            out.fill_(1.0)
        return w, run

    def flashinfer(fi, ws, row, q, qo, kv, tables, backend, **kw):
        if backend == "fa2":
            raise RuntimeError("no such module")

        def run(out):
            calls.append(("fi", backend))
            out.fill_(1.5)
        return run

    def sdpa(row, r):
        r["sdpa_flash_error"] = "RuntimeError: not here"
        return {"sdpa_cudnn": lambda: calls.append(("sdpa", "cudnn"))}

    monkeypatch.setattr(prefill, "_inputs", inputs)
    monkeypatch.setattr(prefill, "_attnjit", attnjit)
    monkeypatch.setattr(prefill, "_flashinfer", flashinfer)
    monkeypatch.setattr(prefill, "_sdpa", sdpa)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_bench_rows_times_every_implementation_together(monkeypatch):
    calls, timed = [], []
    _stand_ins(monkeypatch, calls)

    def time_many(runs):
        timed.append(sorted(runs))
        for run in runs.values():
            run()
        return {name: 0.5 + i for i, name in enumerate(runs)}

    results = []
    prefill.bench_rows(object(), [prefill.Row(1, 64)], results, time_ms=None, ws=None, ws_fi=lambda: None,
                       families=("auto", "fa2"), time_many=time_many)
    assert timed == [["attnjit", "attnjit_fa2", "flashinfer_fa3", "sdpa_cudnn"]]
    (r,) = results
    assert r["attnjit_ms"] == 0.5 and r["attnjit_fa2_ms"] == 1.5 and r["flashinfer_fa3_ms"] == 2.5
    assert r["attnjit_plan"]["tile"] == "auto" and r["attnjit_fa2_plan"]["tile"] == "fa2"
    assert r["flashinfer_fa2_error"].startswith("RuntimeError") and "flashinfer_fa2_ms" not in r
    assert r["sdpa_flash_error"] and r["sdpa_cudnn_tflops"] > 0
    assert r["attnjit_fa2_max_diff"] == 0.0 and r["flashinfer_fa3_max_diff"] == 0.5
    assert "attnjit_max_diff" not in r


def test_bench_rows_one_after_another_without_time_many(monkeypatch):
    calls = []
    _stand_ins(monkeypatch, calls)
    seen = []
    results = []
    prefill.bench_rows(None, [prefill.Row(1, 64)], results, time_ms=lambda run: (seen.append(run), run(), 2.0)[2],
                       ws=None, ws_fi=lambda: None, families=("auto",))
    assert len(seen) == 2 and results[0]["attnjit_ms"] == 2.0 and results[0]["sdpa_cudnn_ms"] == 2.0


def test_bench_variants_rows_and_diffs(monkeypatch):
    calls = []
    _stand_ins(monkeypatch, calls)

    def time_many(runs):
        assert all(isinstance(k, tuple) for k in runs)
        for run in runs.values():
            run()
        return {k: 1.0 + k[0] for k in runs}

    results = []
    prefill.bench_variants(object(), results, time_ms=None, ws=None, ws_fi=lambda: None, time_many=time_many,
                           fi_skip=frozenset({"fa3:window"}))
    assert [r["feature"] for r in results] == [v[0] for v in prefill.VARIANTS]
    assert [r["attnjit_ms"] for r in results] == [1.0 + i for i in range(len(prefill.VARIANTS))]
    soft = results[1]
    assert soft["flashinfer_fa3_ms"] == 2.0 and soft["flashinfer_fa3_max_diff"] == 0.5
    assert results[2]["flashinfer_fa3_error"].startswith("skipped")
    assert "flashinfer_fa3_ms" not in results[3]   # ALiBi: FlashInfer has no such feature here
