"""benchmarks/clocks.py: the join of a run's timed spans with nvidia-smi's clock samples (no GPU needed)."""

from __future__ import annotations

import json
from datetime import datetime

from benchmarks import clocks


def _csv(tmp_path, rows):
    lines = [f"{datetime.fromtimestamp(t).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {mhz}, {w}, {c}"
             for t, mhz, w, c in rows]
    p = tmp_path / "clocks.csv"
    p.write_text("\n".join(lines + ["garbage line", "2026/12/06 bad, x, y, z"]) + "\n")
    return p


def test_spans_record_each_call_in_order():
    calls = iter([1.5, 0.25])
    timed = clocks.Spans(lambda fn, **kw: next(calls))
    assert timed(lambda: None) == 1.5
    assert timed(lambda: None, reps=3) == 0.25
    assert [s[2] for s in timed.spans] == [1.5, 0.25]
    assert all(t0 <= t1 for t0, t1, _ in timed.spans)


def test_blocks_named_by_their_ms_and_averaged(tmp_path):
    base = 1_800_000_000.0
    csv = _csv(tmp_path, [(base + 0.0, 1980, 300, 40), (base + 0.1, 1980, 310, 40), (base + 1.0, 1600, 690, 60),
                          (base + 1.1, 1700, 700, 62), (base + 5.0, 1400, 200, 50)])
    samples = clocks.read_samples(csv)
    assert len(samples) == 5   # the two lines that do not parse are skipped
    doc = {"meta": {"spans": [[base - 0.01, base + 0.15, 0.5], [base + 0.95, base + 1.2, 0.75],
                              [base + 4.0, base + 4.001, 9.0]]},
           "prefill": [{"shape": "8x2048", "attnjit_ms": 0.5, "sdpa_cudnn_ms": 0.75}]}
    got = clocks.blocks(doc)
    assert [g[0] for g in got] == ["prefill 8x2048 attnjit", "prefill 8x2048 sdpa_cudnn", "span 2"]
    first = clocks.during(samples, got[0][1], got[0][2])
    assert first == {"sm_mhz": 1980, "watts": 305, "celsius": 40, "samples": 2}
    second = clocks.during(samples, got[1][1], got[1][2])
    assert second["sm_mhz"] == 1650 and second["watts"] == 695
    # a span between samples takes the nearest one (base + 5.0, 1 s away, against base + 1.1, 2.9 s)
    third = clocks.during(samples, got[2][1], got[2][2])
    assert third["samples"] == 1 and third["sm_mhz"] == 1400
    assert clocks.during([], 0.0, 1.0) is None


def test_interleaved_blocks_are_spans_named_by_their_function_and_row(tmp_path):
    """time_many's blocks (through Spans.interleaved) join the spans, each named by the row value its function's
    figure became, beside time_ms's own spans."""
    def fake_time_many(fns, on_block=None, reps=30):
        for k, name in enumerate(["attnjit", "sdpa_cudnn", "sdpa_cudnn", "attnjit"]):
            on_block(name, 10.0 + k, 10.5 + k, {"attnjit": 0.5, "sdpa_cudnn": 0.75}[name] + k / 100)
        return {"attnjit": 0.515, "sdpa_cudnn": 0.765}

    spans = clocks.Spans(lambda fn, **kw: 9.0)
    spans(lambda: None)
    timed = spans.interleaved(fake_time_many)
    assert timed({"attnjit": None, "sdpa_cudnn": None}, reps=5) == {"attnjit": 0.515, "sdpa_cudnn": 0.765}
    assert len(spans.spans) == 5 and spans.spans[1] == [10.0, 10.5, 0.5, "attnjit", 0.515]
    doc = {"meta": {"spans": spans.spans},
           "prefill": [{"shape": "8x2048", "attnjit_ms": 0.515, "sdpa_cudnn_ms": 0.765}]}
    names = [g[0] for g in clocks.blocks(doc)]
    a, c = "prefill 8x2048 attnjit (block of attnjit)", "prefill 8x2048 sdpa_cudnn (block of sdpa_cudnn)"
    assert names == ["span 0", a, c, c, a]
    assert [g[3] for g in clocks.blocks(doc)][1:] == [0.5, 0.76, 0.77, 0.53]


def test_main_prints_one_line_a_block(tmp_path, capsys):
    base = 1_800_000_000.0
    csv = _csv(tmp_path, [(base, 1755, 650, 55)])
    res = tmp_path / "t.json"
    res.write_text(json.dumps({"8x2048": {"tflops": 556.6, "span": [base - 0.05, base + 0.05]}}))
    assert clocks.main([str(res), str(csv)]) == 0
    out = capsys.readouterr().out
    assert "8x2048 556.6 TFLOP/s" in out and "1755 MHz 650 W 55 C (1)" in out
    empty = tmp_path / "e.json"
    empty.write_text("{}")
    assert clocks.main([str(empty), str(csv)]) == 1
