"""The example model on the GPU: attnjit's attention in a Llama-style model against transformers'
LlamaForCausalLM (same config, same seeded random weights), with requests joining and leaving mid-run, pages
reused; CUDA-graph decode equal to eager; strict mode from a warmed cache."""

from __future__ import annotations

import pytest
import torch

import attnjit
from attnjit import dispatch
from attnjit.models import Engine, LlamaConfig, LlamaWeights, transformers_logits

pytest.importorskip("transformers", reason="the model tests need transformers (the 'model' extra)")

DEV = "cuda"
# (prompt length, tokens to generate, arrival step): 6 requests over 4 slots, so some wait for others to finish
WORKLOAD = [(37, 12, 0), (5, 20, 0), (130, 8, 1), (1, 16, 3), (64, 10, 6), (300, 6, 9)]
CONFIG = LlamaConfig.tiny()


# decodes of 1, 2, 3 and 4 requests as they finish: graph buckets 1, 2 and 4 (3 padded to 4)
STAGGERED = [(37, 30, 0), (5, 8, 0), (130, 20, 1), (1, 40, 3), (64, 12, 6)]


def _engine(weights, dtype, *, graphs=False, max_batch_tokens=128, seed=1, workload=WORKLOAD, **kw):
    attn_dtype = torch.float16 if dtype == torch.float32 else dtype
    eng = Engine(CONFIG, weights, backend="attnjit", device=DEV, dtype=dtype, attn_dtype=attn_dtype, page_size=16,
                 num_pages=30, max_model_len=512, max_batch_tokens=max_batch_tokens, max_running=4,
                 cuda_graphs=graphs, keep_logits=True, check_pages=True, **kw)
    g = torch.Generator().manual_seed(seed)
    reqs = [eng.add(torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist(), m, arrival=a)
            for n, m, a in workload]
    eng.run()
    return eng, reqs


@pytest.mark.parametrize("max_batch_tokens", [128, 16])
def test_matches_transformers_fp32_model_fp16_attention(max_batch_tokens):
    """Greedy tokens equal to transformers' at every step; logits within 3e-3 (abs) of float32 transformers. The
    model runs in float32 with q/K/V/attention in fp16 (the kernels' types), so the difference is attention's."""
    weights = LlamaWeights.random(CONFIG, dtype=torch.float32, device=DEV, seed=11)
    eng, reqs = _engine(weights, torch.float32, max_batch_tokens=max_batch_tokens)
    assert eng.stats.mixed_steps > 0 and eng.stats.decode_steps > 0
    assert eng.alloc.reuses > 0 and eng.alloc.num_used == 0     # pages were reused; none leaked
    ref = transformers_logits(CONFIG, weights, reqs, DEV)
    for r in reqs:
        assert len(r.generated) == r.max_new_tokens
        ours = torch.stack(eng.logits[r.id]).double()
        diff = (ours - ref[r.id]).abs().max().item()
        top2 = ref[r.id].topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        assert diff < 3e-3, f"request {r.id}: max |logit diff| {diff:.2e}"
        assert ref[r.id].argmax(-1).tolist() == r.generated, (
            f"request {r.id}: tokens differ from transformers (max diff {diff:.2e}, smallest top-2 margin {margin:.2e})")


def test_bf16_model_close_to_transformers():
    """The serving configuration (bf16 weights, activations, cache): logits within 5% (relative L2) of float32
    transformers on the same tokens."""
    weights = LlamaWeights.random(CONFIG, dtype=torch.bfloat16, device=DEV, seed=12)
    eng, reqs = _engine(weights, torch.bfloat16)
    ref = transformers_logits(CONFIG, weights, reqs, DEV)
    agree = total = 0
    for r in reqs:
        ours = torch.stack(eng.logits[r.id]).double()
        rel = ((ours - ref[r.id]).norm() / ref[r.id].norm()).item()
        assert rel < 5e-2, f"request {r.id}: relative logit error {rel:.3f}"
        agree += sum(a == b for a, b in zip(ref[r.id].argmax(-1).tolist(), r.generated))
        total += len(r.generated)
    assert agree / total > 0.8, f"only {agree}/{total} greedy tokens agree with transformers"


def test_graph_replay_equals_eager():
    weights = LlamaWeights.random(CONFIG, dtype=torch.bfloat16, device=DEV, seed=13)
    eager, reqs_e = _engine(weights, torch.bfloat16, graphs=False, workload=STAGGERED)
    graphed, reqs_g = _engine(weights, torch.bfloat16, graphs=True, workload=STAGGERED)
    assert graphed.stats.graph_replays == graphed.stats.decode_steps > 0
    assert set(graphed.stats.buckets) == {1, 2, 4}    # batch sizes changed as requests left; 3 ran padded to 4
    for a, b in zip(reqs_e, reqs_g):
        assert a.generated == b.generated, f"request {a.id}"
        la, lb = torch.stack(eager.logits[a.id]), torch.stack(graphed.logits[b.id])
        assert (la - lb).abs().max().item() < 2e-2 * la.abs().max().item()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_engine_plans_from_host_page_ids_without_synchronizing(monkeypatch, graphs):
    """With attnjit the engine hands plan() (and, replaying graphs, fast_plan()) the host copy of the page ids, so
    they are never read back from the device (which synchronizes every step); the run still matches the eager
    one's tokens."""
    seen = {"plan": [], "fast_plan": []}
    W = attnjit.BatchDecodeWithPagedKVCacheWrapper
    for name in seen:
        def spy(self, indptr, indices, *args, _real=getattr(W, name), _name=name, **kw):
            seen[_name].append((indptr.device.type, indices.device.type))
            return _real(self, indptr, indices, *args, **kw)
        monkeypatch.setattr(W, name, spy)
    weights = LlamaWeights.random(CONFIG, dtype=torch.bfloat16, device=DEV, seed=13)
    eng, reqs = _engine(weights, torch.bfloat16, graphs=graphs, workload=STAGGERED)
    calls = seen["plan"] + seen["fast_plan"]
    assert eng.host_page_ids and calls and set(calls) == {("cpu", "cpu")}, seen
    # graph mode: each bucket is planned once when captured, then every replay re-plans with fast_plan()
    assert len(seen["fast_plan"]) == eng.stats.fast_replans == (eng.stats.graph_replays if graphs else 0), seen
    assert all(len(r.generated) == m for r, (_, m, _) in zip(reqs, STAGGERED))


def test_strict_mode_after_warming_the_recorded_specs(tmp_path, monkeypatch):
    """The loop in-process: record a run, warm exactly its specs, then strict mode (ATTNJIT_JIT=0) runs with every
    dispatch a disk or memory hit."""
    weights = LlamaWeights.random(CONFIG, dtype=torch.bfloat16, device=DEV, seed=14)
    with attnjit.recording() as rec:
        _engine(weights, torch.bfloat16)
    specs = rec.specs()
    assert {s.op for s in specs} == {"prefill", "decode", "append_kv"}
    monkeypatch.setenv("ATTNJIT_CACHE_DIR", str(tmp_path / "cache"))
    dispatch.clear_memory()
    attnjit.warm(specs)
    dispatch.clear_memory()
    monkeypatch.setenv("ATTNJIT_JIT", "0")
    try:
        with attnjit.recording() as rec2:
            eng, _ = _engine(weights, torch.bfloat16)
    finally:
        dispatch.clear_memory()
    assert eng.stats.steps > 0 and rec2
    assert {r.binary for r in rec2} <= {"disk", "memory"}
    assert sorted(set(rec2.specs()), key=str) == sorted(set(specs), key=str)
