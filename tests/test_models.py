"""The example model's host side, in CI: page allocator, continuous-batching scheduler, the seed's three-request
batch as a model step, and the whole engine on the CPU (float64 reference attention) against transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnjit import reference
from attnjit.models import (Engine, LlamaConfig, LlamaWeights, OutOfPagesError, PageAllocator, Request, Scheduler,
                            transformers_logits)


def test_allocator_reuses_pages_and_never_shares_or_leaks():
    a = PageAllocator(9, 4, reserved=1)
    assert a.num_free == 8
    assert a.ensure("x", 5) == [1, 2] and a.ensure("x", 8) == [] and a.ensure("y", 12) == [3, 4, 5]
    assert 0 not in a.pages("x") + a.pages("y")          # the reserved scratch page is never handed out
    a.check()
    assert a.free("x") == 2 and a.num_free == 5
    assert a.ensure("z", 20) == [6, 7, 8, 1, 2]           # FIFO: freed pages come back last, then are reused
    assert a.reuses == 2
    a.check()
    with pytest.raises(OutOfPagesError, match="needs 1 more pages"):
        a.ensure("w", 1)
    assert "w" not in a._pages and a.num_free == 0       # a failed allocation allocates nothing
    with pytest.raises(KeyError, match="freed twice"):
        a.free("x")
    a.free("y"), a.free("z")
    a.check()
    assert a.num_used == 0 and a.num_free == 8


def test_allocator_check_catches_corruption():
    a = PageAllocator(5, 2)
    a.ensure("x", 4)
    a._free.append(a.pages("x")[0])                      # a page both free and owned
    with pytest.raises(AssertionError, match="both free and owned"):
        a.check()


def test_seed_three_request_batch_as_a_model_step():
    """The seed's batch: R0 has 3 cached + 3 new tokens, R1 decodes its second token, R2 has 5 cached + 4 new:
    qo_indptr [0,3,4,8], KV lengths [6,2,9], page_size 4 -> last_page_len [2,2,1]; R2's token 5 sits in its
    second page, slot 1."""
    a = PageAllocator(16, 4)
    s = Scheduler(a, max_batch_tokens=8, max_running=3)
    r0 = Request(id=0, prompt=list(range(10, 16)), max_new_tokens=4, num_computed=3, state="running")
    r1 = Request(id=1, prompt=[7], max_new_tokens=4, generated=[8], num_computed=1, state="running")
    r2 = Request(id=2, prompt=list(range(20, 32)), max_new_tokens=2, num_computed=5, state="running")
    for r, cached in ((r0, 3), (r1, 1), (r2, 5)):
        a.ensure(r.id, cached)
        s.running.append(r)
    b = s.schedule()
    assert b.qo_indptr == [0, 3, 4, 8] and b.kv_lens == [6, 2, 9] and b.kv_last_page_len == [2, 2, 1]
    assert b.kv_indptr == [0, 2, 3, 6] and b.kv_indices == a.pages(0) + a.pages(1) + a.pages(2)
    assert b.token_ids == [13, 14, 15, 8, 25, 26, 27, 28]
    assert b.positions == [3, 4, 5, 1, 5, 6, 7, 8] and b.batch_indices == [0, 0, 0, 1, 2, 2, 2, 2]
    assert reference.token_address(b.kv_indices[3:6], 4, 5) == (a.pages(2)[1], 1)
    assert b.logit_rows == [2, 3] and not b.decode_only   # R0's prompt ends here; R1 decodes; R2 continues
    s.commit(b, [40, 41])
    assert r0.generated == [40] and r1.generated == [8, 41] and r2.num_computed == 9 and r2.generated == []


def test_scheduler_chunks_admits_on_arrival_and_frees_on_finish():
    a = PageAllocator(1 + 6, 4)
    s = Scheduler(a, max_batch_tokens=5, max_running=2)
    long = Request(id=0, prompt=list(range(12)), max_new_tokens=3)       # 14 KV tokens: 4 pages
    short = Request(id=1, prompt=[1, 2], max_new_tokens=2, arrival=1)     # 3 KV tokens: 1 page
    late = Request(id=2, prompt=[3], max_new_tokens=9, arrival=1)         # 9 KV tokens: 3 pages: must wait
    for r in (long, short, late):
        s.add(r)
    with pytest.raises(ValueError, match="can need 8 pages"):
        s.add(Request(id=3, prompt=list(range(30)), max_new_tokens=1))
    seen = []
    while s.has_work:
        b = s.schedule()
        if b is None:
            s.idle_step()
            continue
        assert b.num_tokens <= 5
        seen.append([(it.request.id, len(it.tokens)) for it in b.items])
        s.commit(b, [99] * len(b.logit_rows))
        a.check()
        assert a.num_used <= 6
    assert seen[0] == [(0, 5)]                          # the short request has not arrived yet
    assert seen[1] == [(0, 5), ]                        # arrived, but no pages: the long prompt claims 4 of 6
    assert (1, 2) in seen[2] and (0, 2) in seen[2]      # prompt's last chunk + the short request admitted
    assert all(r.state == "finished" and len(r.generated) == r.max_new_tokens for r in (long, short, late))
    assert late.finished_step > short.finished_step and a.num_used == 0 and a.reuses > 0


def test_engine_on_cpu_matches_transformers():
    """The whole engine (paging, chunked prefill mixed with decode, RoPE positions, GQA) with the float64
    reference attention, against transformers' LlamaForCausalLM in float32: equal greedy tokens."""
    pytest.importorskip("transformers", reason="needs transformers (the 'model' extra)")
    cfg = LlamaConfig.tiny(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=1, vocab_size=512)
    w = LlamaWeights.random(cfg, dtype=torch.float32, device="cpu", seed=1)
    eng = Engine(cfg, w, backend="reference", device="cpu", dtype=torch.float32, attn_dtype=torch.float16,
                 page_size=4, num_pages=10, max_batch_tokens=16, max_running=3, max_model_len=128, keep_logits=True,
                 check_pages=True)
    g = torch.Generator().manual_seed(5)
    reqs = [eng.add(torch.randint(0, 512, (n,), generator=g).tolist(), m, arrival=t)
            for n, m, t in ((3, 6, 0), (1, 4, 0), (20, 5, 1), (9, 8, 3), (5, 3, 6))]
    eng.run()
    assert eng.stats.mixed_steps and eng.stats.decode_steps and eng.alloc.reuses > 0 and eng.alloc.num_used == 0
    refs = transformers_logits(cfg, w, reqs, "cpu")
    for r in reqs:
        ref = refs[r.id]
        ours = torch.stack(eng.logits[r.id]).double()
        assert (ours - ref).abs().max().item() < 3e-3, r.id
        assert ref.argmax(-1).tolist() == r.generated, r.id


# --- the record-to-catalog loop on the record of a real run (examples/llama_serving.py --graphs on the H200) ------

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "data" / "llama-run.jsonl"


def _cli(*args, env=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "attnjit.cli", *args], capture_output=True, text=True, env=env)


def test_catalog_from_the_model_record_is_the_committed_catalog(tmp_path):
    """`attnjit catalog from-log` on the committed record writes specs/llama-example.toml byte for byte: exactly the
    three specs that ran (append, causal prefill for mixed steps, decode), whatever the binary source was."""
    records = [json.loads(line) for line in RECORD.read_text().splitlines()]
    assert {r["op"] for r in records} == {"append_kv", "prefill", "decode"} and len(records) > 3
    out = tmp_path / "llama-example.toml"
    proc = _cli("catalog", "from-log", str(RECORD), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == (ROOT / "specs" / "llama-example.toml").read_text()


@pytest.mark.nvcc
def test_warm_the_model_catalog_without_a_gpu(tmp_path):
    """What CI does before production: build every spec of the catalog (no GPU needed), once."""
    env = {"ATTNJIT_CACHE_DIR": str(tmp_path / "cache")}
    first = _cli("warm", str(ROOT / "specs" / "llama-example.toml"), env=env)
    assert first.returncode == 0, first.stderr
    assert "3 specs: 3 built, 0 cached, 0 failed" in first.stdout
    again = _cli("warm", str(ROOT / "specs" / "llama-example.toml"), env=env)
    assert "3 specs: 0 built, 3 cached, 0 failed" in again.stdout
    verify = _cli("cache", "verify", env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_bad_requests_and_settings_name_the_problem():
    from attnjit.models.backends import load_ops

    cfg = LlamaConfig.tiny(hidden_size=256, intermediate_size=256, num_layers=1, vocab_size=64)
    w = LlamaWeights.random(cfg, dtype=torch.float32, device="cpu", seed=0)
    eng = Engine(cfg, w, backend="reference", device="cpu", dtype=torch.float32, attn_dtype=torch.float16,
                 page_size=4, num_pages=8, max_model_len=32, max_running=2)
    with pytest.raises(ValueError, match="outside 0..63"):
        eng.add([1, 64], 2)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add([], 2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        eng.add([1], 0)
    with pytest.raises(ValueError, match="exceeds max_model_len=32"):
        eng.add([1] * 30, 5)
    with pytest.raises(ValueError, match="unknown attention backend 'vllm'"):
        load_ops("vllm")
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        Engine(cfg, w, backend="reference", device="cpu", dtype=torch.float32, cuda_graphs=True)
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        LlamaConfig.tiny(num_heads=6, num_kv_heads=4)
