"""Context parallelism on the CPU: the page-table split (a pure function), the causal rule in global positions,
the per-rank decomposition, and real gloo groups of 2 and 3 spawned ranks (float64 reference backend) against the
single-process reference, the example engine included."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attnjit import reference
from attnjit.distributed import (ContextParallelDecode, ContextParallelPrefill, context_parallel_ops,
                                 global_key_positions, launch, shard_page_table, token_owner)
from attnjit.distributed.causal import reference_hooks
from attnjit.distributed.local import AttnjitShard, ReferenceShard
from attnjit.errors import NoGPUError

from .helpers import i32, make_paged

ROOT = Path(__file__).resolve().parents[1]
H_Q, H_KV, D = 4, 2, 16


# --- the split of the page table -----------------------------------------------------------------------------

def test_shard_table_of_a_small_batch():
    """Three requests of 3, 1 and 0 pages (page_size 4; KV 10, 1, 0) over 2 ranks: rank 0 holds logical pages 0, 2
    of request 0 (its last page, 2 tokens) and request 1's only page; rank 1 holds page 1 of request 0 (full)."""
    r0 = shard_page_table([0, 3, 4, 4], [2, 1, 0], page_size=4, world=2, rank=0)
    assert r0.select.tolist() == [0, 2, 3] and r0.kv_indptr.tolist() == [0, 2, 3, 3]
    assert r0.last_page_len.tolist() == [2, 1, 0] and r0.kv_lens.tolist() == [6, 1, 0]
    assert r0.global_kv_lens.tolist() == [10, 1, 0] and r0.has_keys.tolist() == [True, True, False]
    assert r0.q_shift.tolist() == [4, 0, 0]
    assert r0.page_ids([70, 71, 72, 73]) == [70, 72, 73]
    r1 = shard_page_table([0, 3, 4, 4], [2, 1, 0], page_size=4, world=2, rank=1, pad_empty=True)
    assert r1.select.tolist() == [1, -1, -1] and r1.kv_indptr.tolist() == [0, 1, 2, 3]
    assert r1.last_page_len.tolist() == [4, 1, 1] and r1.kv_lens.tolist() == [4, 1, 1]
    assert r1.has_keys.tolist() == [True, False, False]
    assert r1.page_ids([70, 71, 72, 73], scratch_page=0) == [71, 0, 0]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_partition_every_request_in_global_order(world):
    """Random tables (odd page counts, requests shorter than the world, empty ones): every global page entry is
    selected by exactly one rank, p % world == rank, in logical order; the local lengths follow the seed's rule and
    sum to K; the local keys' global positions cover 0..K-1 once each, increasing on every rank."""
    rng = np.random.default_rng(world)
    page_size = 3
    for _ in range(20):
        pages = rng.integers(0, 9, size=6)
        last = np.where(pages > 0, rng.integers(1, page_size + 1, size=6), 0)
        kvp = np.concatenate([[0], np.cumsum(pages)])
        tables = [shard_page_table(kvp, last, page_size=page_size, world=world, rank=r) for r in range(world)]
        chosen = np.concatenate([t.select for t in tables])
        assert sorted(chosen.tolist()) == list(range(int(kvp[-1])))
        for b in range(6):
            K = int(tables[0].global_kv_lens[b])
            assert K == (page_size * (pages[b] - 1) + last[b] if pages[b] else 0)
            seen = []
            for r, t in enumerate(tables):
                sel = t.select[t.kv_indptr[b]:t.kv_indptr[b + 1]]
                assert ((sel - kvp[b]) % world == r).all() and (np.diff(sel) == world).all()
                n_local = len(sel)
                L = int(t.kv_lens[b])
                assert L == (page_size * (n_local - 1) + t.last_page_len[b] if n_local else 0)
                assert (1 <= t.last_page_len[b] <= page_size) if n_local else t.last_page_len[b] == 0
                g = global_key_positions(np.arange(L), page_size=page_size, world=world, rank=r)
                assert (np.diff(g) > 0).all() and (token_owner(g, page_size=page_size, world=world) == r).all()
                seen += g.tolist()
            assert sorted(seen) == list(range(K))


def test_pad_empty_adds_one_scratch_entry_only_where_a_rank_has_no_key():
    kvp, last = [0, 1, 5, 5], [3, 2, 0]
    plain = shard_page_table(kvp, last, page_size=4, world=3, rank=2)
    padded = shard_page_table(kvp, last, page_size=4, world=3, rank=2, pad_empty=True)
    assert plain.kv_lens.tolist() == [0, 4, 0] and plain.select.tolist() == [3]
    assert padded.select.tolist() == [-1, 3, -1] and padded.kv_lens.tolist() == [1, 4, 1]
    assert padded.last_page_len.tolist() == [1, 4, 1] and padded.has_keys.tolist() == [False, True, False]


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(kv_indptr=[1, 2], last_page_len=[1]), ValueError, r"kv_indptr must start with 0"),
    (dict(kv_indptr=[0, 2, 1], last_page_len=[1, 1]), ValueError, r"kv_indptr must be non-decreasing"),
    (dict(kv_indptr=[0, 2], last_page_len=[5]), ValueError, r"last_page_len\[0\]=5 must be in 1..page_size=4"),
    (dict(kv_indptr=[0, 0], last_page_len=[2]), ValueError, r"last_page_len\[0\]=2 .* \(0 for one without\)"),
    (dict(kv_indptr=[0, 2], last_page_len=[1, 1]), ValueError, r"last_page_len must have 1 elements"),
    (dict(kv_indptr=[0, 2], last_page_len=[1], rank=2), ValueError, r"rank must be an int in 0..world-1 = 0..1"),
    (dict(kv_indptr=[0, 2], last_page_len=[1], world=0), ValueError, r"world must be an int >= 1"),
    (dict(kv_indptr=[0.0, 2.0], last_page_len=[1]), TypeError, r"kv_indptr must be a 1-D sequence of ints"),
])
def test_shard_errors_name_the_argument(kwargs, exc, pattern):
    args = dict(page_size=4, world=2, rank=0) | kwargs
    with pytest.raises(exc, match=pattern):
        shard_page_table(args.pop("kv_indptr"), args.pop("last_page_len"), **args)


# --- the causal rule on a shard -----------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_shard_mask_is_the_global_causal_rule_on_the_shards_keys(world):
    """reference_hooks' mask (local positions, the kernel's view) equals the bottom-right causal mask of the whole
    request restricted to the shard's keys, for a chunk of Q queries that straddles several shards' pages."""
    page_size, K, Q = 4, 23, 20
    full = reference.causal_visible(Q, K)                                   # [Q, K] in global positions
    rows_without_keys = []
    for r in range(world):
        t = shard_page_table([0, 6], [3], page_size=page_size, world=world, rank=r)
        L = int(t.kv_lens[0])
        pos = reference.Positions(q_pos=torch.arange(Q) + (L - Q), kv_pos=torch.arange(L), head=torch.arange(1),
                                  batch_idx=0, qo_len=Q, kv_len=L)
        mask = reference_hooks(t).mask(pos)[0]
        g = global_key_positions(torch.arange(L), page_size=page_size, world=world, rank=r)
        assert torch.equal(mask, full[:, g])
        assert not mask.all()                # the chunk sees part of every shard
        rows_without_keys.append(int((~mask).all(dim=1).sum()))
    # row 0 (position 3) sees no key of rank 1 (keys from 4 on), rows at 3..7 none of rank 2 (keys from 8 on)
    assert rows_without_keys == [0, 1] if world == 2 else rows_without_keys == [0, 1, 5]


# name -> (qo_lens, kv_lens, page_size, layout, causal, op, combine); decode: qo_lens None
CASES = {
    # KV 2 = one page (shorter than the world), 7/7 and 5/5 whole prompts (queries see part of every shard), odd counts
    "prefill_causal": ([3, 1, 4, 7, 2, 5], [6, 2, 9, 7, 30, 5], 4, "NHD", True, "prefill", "all_gather"),
    "prefill_causal_reduce": ([3, 1, 4, 7, 2, 5], [6, 2, 9, 7, 30, 5], 4, "NHD", True, "prefill", "all_reduce"),
    "prefill_causal_hnd": ([2, 6, 1], [11, 6, 1], 3, "HND", True, "prefill", "all_gather"),
    "prefill_noncausal": ([2, 3], [5, 13], 4, "NHD", False, "prefill", "all_gather"),
    "decode": (None, [1, 5, 17, 33, 64, 3], 4, "NHD", False, "decode", "all_gather"),
    "decode_reduce": (None, [1, 5, 17, 33, 64, 3], 4, "NHD", False, "decode", "all_reduce"),
}


def _batch(name):
    qo, kv, ps, layout, *_ = CASES[name]
    return make_paged(qo if qo is not None else [1] * len(kv), kv, page_size=ps, num_qo_heads=H_Q, num_kv_heads=H_KV,
                      head_dim=D, dtype=torch.float64, layout=layout, seed=len(name))


def _expected(name):
    _, _, ps, layout, causal, _, _ = CASES[name]
    b = _batch(name)
    return reference.batch_paged(b.q, b.cache, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len,
                                 page_size=ps, causal=causal, layout=layout)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", [n for n in CASES if not n.endswith("_reduce")])
def test_per_rank_states_merge_to_the_whole(name, world):
    """Without processes: each rank's state from its shard (ReferenceShard, dummy entries turned empty) merged with
    reference.merge_states equals attention over the whole history."""
    _, _, ps, layout, causal, op, _ = CASES[name]
    b = _batch(name)
    qo = np.asarray(b.qo_indptr)
    states = []
    for r in range(world):
        t = shard_page_table(b.kv_indptr, b.last_page_len, page_size=ps, world=world, rank=r, pad_empty=True)
        shard = ReferenceShard(op=op, kv_layout=layout)
        shard.plan(qo_indptr=qo, table=t, page_ids=i32(t.page_ids(b.kv_indices)), causal=causal, sm_scale=None,
                   head_dim=D)
        o = torch.full(b.q.shape, math.nan, dtype=torch.float64)
        lse = torch.full(b.q.shape[:2], math.nan, dtype=torch.float64)
        shard.run(b.q, b.cache, o, lse)
        empty = torch.as_tensor(~np.repeat(t.has_keys, np.diff(qo)))
        o[empty], lse[empty] = 0.0, -math.inf
        states.append((o, lse))
    o, lse = reference.merge_states(torch.stack([s[0] for s in states], 1), torch.stack([s[1] for s in states], 1))
    ref_o, ref_lse = _expected(name)
    assert (o - ref_o).abs().max().item() < 1e-12
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert (lse - ref_lse)[torch.isfinite(ref_lse)].abs().max().item() < 1e-12


def test_attnjit_shard_plans_the_masked_prefill_on_a_cpu():
    """The GPU path up to the kernel: the local attnjit prefill is planned non-causal with the cp_causal variant,
    and run() accepts its parameters (rank, world, page_size, the per-request shift), failing only for want of a
    GPU."""
    b = _batch("prefill_causal")
    t = shard_page_table(b.kv_indptr, b.last_page_len, page_size=4, world=2, rank=1, pad_empty=True)
    shard = AttnjitShard(op="prefill", workspace=torch.empty(1 << 20, dtype=torch.uint8), kv_layout="NHD",
                         use_cuda_graph=False, batch_capacity=None, page_capacity=None)
    shard.plan(qo_indptr=np.asarray(b.qo_indptr), table=t, page_ids=i32(t.page_ids(b.kv_indices)), causal=True,
               sm_scale=None, num_qo_heads=32, num_kv_heads=8, head_dim=128, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16)
    w = shard._current
    assert w._plan.spec.mask == "none" and w._plan.spec.variant.name == "cp_causal"
    assert shard._run_args["cp_q_shift"].tolist() == t.q_shift.tolist()
    assert shard.o_dtype == torch.bfloat16
    q = torch.randn(b.q.shape[0], 32, 128, dtype=torch.bfloat16)
    cache = torch.randn(b.cache.shape[0], 2, 4, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(NoGPUError, match="kernels run on CUDA devices only"):
        shard.run(q, cache, torch.empty_like(q), torch.empty(q.shape[:2]))


# --- real process groups (gloo), 2 and 3 ranks -----------------------------------------------------------------

def _engine(cfg_seed, ops=None, **kw):
    from attnjit.models import Engine, LlamaConfig, LlamaWeights

    cfg = LlamaConfig.tiny(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=1, vocab_size=512)
    w = LlamaWeights.random(cfg, dtype=torch.float32, device="cpu", seed=cfg_seed)
    eng = Engine(cfg, w, backend="reference", device="cpu", dtype=torch.float32, attn_dtype=torch.float16,
                 page_size=4, num_pages=12, max_batch_tokens=16, max_running=3, max_model_len=128, keep_logits=True,
                 check_pages=True, ops=ops, **kw)
    g = torch.Generator().manual_seed(5)
    reqs = [eng.add(torch.randint(0, 512, (n,), generator=g).tolist(), m, arrival=t)
            for n, m, t in ((3, 6, 0), (1, 4, 0), (20, 5, 1), (9, 8, 3), (5, 3, 6))]
    eng.run()
    return eng, reqs


def own_pages_only(cache: torch.Tensor, kv_indptr, kv_indices, last_page_len, *, page_size: int, world: int,
                   rank: int) -> torch.Tensor:
    """This rank's cache: a copy with every page it does not own (scratch page 0 included) set to NaN, so a read
    of another rank's page shows in the result."""
    t = shard_page_table(kv_indptr, last_page_len, page_size=page_size, world=world, rank=rank)
    mine = torch.zeros(cache.shape[0], dtype=torch.bool, device=cache.device)
    mine[torch.as_tensor(t.page_ids(list(kv_indices)), dtype=torch.long, device=cache.device)] = True
    local = cache.clone()
    local[~mine] = math.nan
    return local


def _rank_main(rank: int, world: int, out_dir: str) -> None:
    """Every case through the wrappers, and the example engine, on one rank; results saved for the parent."""
    res = {}
    ws = torch.empty(1, dtype=torch.uint8)
    for name, (_, _, ps, layout, causal, op, combine) in CASES.items():
        b = _batch(name)
        b.cache = own_pages_only(b.cache, b.kv_indptr, b.kv_indices, b.last_page_len, page_size=ps, world=world,
                                 rank=rank)
        qo, kvp, idx, last = b.tensors("cpu")
        if op == "decode":
            w = ContextParallelDecode(ws, layout, local_backend="reference", combine=combine)
            w.plan(kvp, idx, last, H_Q, H_KV, D, ps, q_data_type=torch.float64)
        else:
            w = ContextParallelPrefill(ws, layout, local_backend="reference", combine=combine)
            w.plan(qo, kvp, idx, last, H_Q, H_KV, D, ps, causal=causal, q_data_type=torch.float64)
        o, lse = w.run(b.q, b.cache, return_lse=True)
        res[name] = (o, lse, w.combiner.local()[1].clone())
    # graph mode keeps every buffer run() touches at one address across plans of one batch size
    b = _batch("decode")
    _, kvp, idx, last = b.tensors("cpu")
    w = ContextParallelDecode(ws, "NHD", use_cuda_graph=True, local_backend="reference",
                              paged_kv_indptr_buffer=kvp.clone(), paged_kv_indices_buffer=idx.clone())
    addresses = []
    for lens in ([1, 5, 17, 33, 64, 3], [2, 9, 4, 40, 1, 12]):
        g = make_paged([1] * 6, lens, page_size=4, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D,
                       dtype=torch.float64, seed=sum(lens))
        _, kvp, idx, last = g.tensors("cpu")
        w.plan(kvp, idx, last, H_Q, H_KV, D, 4, q_data_type=torch.float64)
        w.run(g.q, g.cache)
        o_loc, lse_loc = w.combiner.local()
        addresses.append((o_loc.data_ptr(), lse_loc.data_ptr(), w._empty.data_ptr()))
    res["graph_addresses"] = addresses
    # the example engine with context-parallel attention (world 3 only: world 2 runs through the example script)
    if world == 3:
        eng, reqs = _engine(1, ops=context_parallel_ops("reference"))
        res["engine"] = {r.id: (r.generated, torch.stack(eng.logits[r.id])) for r in reqs}
        res["engine_pages"] = (eng.alloc.reuses, eng.alloc.num_used)
    torch.save(res, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"cp{request.param}")
    launch(_rank_main, request.param, str(out), backend="gloo", timeout_s=120)
    return request.param, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(request.param)]


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_equal_the_single_process_reference(ranks, name):
    world, results = ranks
    ref_o, ref_lse = _expected(name)
    for r, res in enumerate(results):
        o, lse, _ = res[name]
        assert (o - ref_o).abs().max().item() < 1e-12, f"rank {r}"
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"rank {r}"
        assert (lse - ref_lse)[torch.isfinite(ref_lse)].abs().max().item() < 1e-12, f"rank {r}"
    if CASES[name][6] == "all_gather":       # the same merge of the same bytes: bitwise equal on every rank
        assert all(torch.equal(res[name][0], results[0][name][0]) for res in results)


@pytest.mark.parametrize("name", ["prefill_causal", "prefill_causal_hnd", "decode"])
def test_empty_states_on_some_ranks_merge_as_the_identity(ranks, name):
    """Rows whose merged lse is finite but which saw no key on some rank (a future-only shard, or a request with no
    page there) had the empty state (lse = -inf) on that rank and still match the reference."""
    world, results = ranks
    _, ref_lse = _expected(name)
    empty_somewhere = torch.zeros_like(ref_lse, dtype=torch.bool)
    for res in results:
        local_lse = res[name][2]
        assert not torch.isnan(local_lse).any()
        empty_somewhere |= torch.isinf(local_lse) & (local_lse < 0)
    assert (empty_somewhere & torch.isfinite(ref_lse)).any()


def test_graph_mode_keeps_its_buffers(ranks):
    _, results = ranks
    for res in results:
        first, second = res["graph_addresses"]
        assert first == second


def test_engine_over_three_ranks_equals_one_process(ranks):
    world, results = ranks
    if world != 3:
        pytest.skip("the engine runs on the 3-rank group; 2 ranks run through the example script")
    eng, reqs = _engine(1)
    assert results[0]["engine_pages"][1] == 0 and results[0]["engine_pages"][0] > 0
    for r in reqs:
        for res in results:
            tokens, logits = res["engine"][r.id]
            assert tokens == r.generated, f"request {r.id}"
            assert (logits - torch.stack(eng.logits[r.id])).abs().max().item() < 1e-3


def test_example_with_context_parallel_2_generates_the_tokens_of_one_process(tmp_path):
    import importlib.util

    script = ROOT / "examples" / "llama_serving.py"
    spec = importlib.util.spec_from_file_location("llama_serving_example", script)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--json", str(tmp_path / "one.json"), "--max-batch-tokens", "64"]) == 0   # in process
    one = json.loads((tmp_path / "one.json").read_text())
    proc = subprocess.run([sys.executable, str(script), "--json", str(tmp_path / "two.json"), "--max-batch-tokens",
                           "64", "--context-parallel", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    two = json.loads((tmp_path / "two.json").read_text())
    assert "context-parallel over 2 ranks (all_gather)" in proc.stdout
    assert two["context_parallel"] == {"ranks": 2, "combine": "all_gather"}
    assert [r["generated"] for r in two["requests"]] == [r["generated"] for r in one["requests"]]
    assert two["stats"]["mixed_steps"] > 0 and two["stats"]["decode_steps"] > 0


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo group of one rank in this process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("method", ["all_gather", "all_reduce"])
def test_a_nan_state_combines_to_nan_not_to_an_empty_row(world_of_one, method):
    """combine() of a rank's NaN state (a NaN input upstream) stays NaN, o and lse, on both methods; an empty state
    stays (0, -inf) and a finite one itself (one rank: the combine is the identity)."""
    from attnjit.distributed.combine import StateCombiner

    c = StateCombiner(method=method)
    o, lse = c.local_state(3, 1, 4, torch.float32, torch.float32, torch.device("cpu"))
    o.copy_(torch.arange(12, dtype=torch.float32).view(3, 1, 4))
    lse.copy_(torch.tensor([[math.nan], [-math.inf], [2.0]]))
    o[1] = 0
    out, out_lse = c.combine()
    assert torch.isnan(out[0]).all() and torch.isnan(out_lse[0]).all(), (out[0], out_lse[0])
    assert not out[1].any() and out_lse[1].item() == -math.inf
    assert torch.allclose(out[2].double(), o[2].double()) and out_lse[2].item() == pytest.approx(2.0)


def test_attnjit_wrappers_plan_on_a_cpu_in_graph_mode(world_of_one):
    """The GPU configuration of the engine's graph buckets, up to the kernel: fixed buffers sized from the
    engine's, two plans of one batch size with other lengths, run() failing only for want of a GPU."""
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    kvp_buf, idx_buf, last_buf = i32([0] * 5), i32([0] * 64), i32([0] * 4)
    d = ContextParallelDecode(ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=kvp_buf,
                              paged_kv_indices_buffer=idx_buf, paged_kv_last_page_len_buffer=last_buf)
    batches = [make_paged([1] * 4, lens, page_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                          dtype=torch.bfloat16, seed=lens[0]) for lens in ([100, 17, 5, 1], [1, 16, 33, 200])]
    cache = batches[1].cache                      # one cache for every replay (it has the most pages)
    for b in batches:
        _, kvp, idx, last = b.tensors("cpu")
        d.plan(kvp, idx, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
        with pytest.raises(NoGPUError, match="kernels run on CUDA devices only"):
            d.run(b.q, cache)
    with pytest.raises(ValueError, match="first planned for batch size 4; plan\\(\\) got batch size 3"):
        d.plan(i32([0, 1, 2, 3]), i32([1, 2, 3]), i32([1, 1, 1]), 32, 8, 128, 16, q_data_type=torch.bfloat16)
    p = ContextParallelPrefill(ws, "NHD", backend="fa2")
    b = make_paged([3, 1, 4], [6, 2, 9], page_size=4, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                   dtype=torch.bfloat16)
    qo, kvp, idx, last = b.tensors("cpu")
    p.plan(qo, kvp, idx, last, 32, 8, 128, 4, causal=True, q_data_type=torch.bfloat16)
    with pytest.raises(NoGPUError, match="kernels run on CUDA devices only"):
        p.run(b.q, b.cache)


def test_unsupported_arguments_are_rejected_even_when_they_equal_another_arguments_default(world_of_one):
    """0 is not False and 0.0 is not None: window_left=0, logits_soft_cap=0.0 and a custom mask tensor of any size
    are NotImplementedError naming the argument, never silently ignored; the real defaults pass."""
    ws = torch.empty(1, dtype=torch.uint8)
    b = _batch("prefill_causal")
    qo, kvp, idx, last = b.tensors("cpu")
    w = ContextParallelPrefill(ws, local_backend="reference")
    for name, value, shown in (("window_left", 0, "window_left=0"), ("logits_soft_cap", 0.0, "logits_soft_cap=0.0"),
                               ("custom_mask", torch.zeros(1), "custom_mask=a Tensor"),
                               ("custom_mask", torch.ones(5, dtype=torch.bool), "custom_mask=a Tensor"),
                               ("pos_encoding_mode", "ALIBI", "pos_encoding_mode='ALIBI'"),
                               ("use_fp16_qk_reduction", 1, "use_fp16_qk_reduction=1")):
        with pytest.raises(NotImplementedError, match=re.escape(f"plan(): {shown} is not supported")):
            w.plan(qo, kvp, idx, last, H_Q, H_KV, D, 4, causal=True, **{name: value})
    w.plan(qo, kvp, idx, last, H_Q, H_KV, D, 4, causal=True, q_data_type=torch.float64, window_left=-1,
           pos_encoding_mode="NONE", logits_soft_cap=None, custom_mask=None, use_fp16_qk_reduction=False,
           non_blocking=True)


def test_wrapper_errors_name_the_argument(world_of_one):
    """Checked before any collective (a world of one, in this process)."""
    if True:
        ws = torch.empty(1, dtype=torch.uint8)
        b = _batch("prefill_causal")
        qo, kvp, idx, last = b.tensors("cpu")
        w = ContextParallelPrefill(ws, local_backend="reference")
        with pytest.raises(ValueError, match="qo_indptr: request 0 has 7 query rows but a KV length of 6"):
            w.plan(i32([0, 7, 8, 12, 19, 21, 26]), kvp, idx, last, H_Q, H_KV, D, 4, causal=True)
        with pytest.raises(TypeError, match="paged_kv_indptr must be int32"):
            w.plan(qo, kvp.long(), idx, last, H_Q, H_KV, D, 4, causal=True)
        with pytest.raises(NotImplementedError, match="logits_soft_cap=30.0 is not supported"):
            w.plan(qo, kvp, idx, last, H_Q, H_KV, D, 4, causal=True, logits_soft_cap=30.0)
        with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\)"):
            w.run(b.q, b.cache)
        w.plan(qo, kvp, idx, last, H_Q, H_KV, D, 4, causal=True, q_data_type=torch.float64)
        with pytest.raises(ValueError, match=r"q must be \[rows, H_q, D\] = \[22, 4, 16\]"):
            w.run(b.q[:3], b.cache)
        d = ContextParallelDecode(ws, local_backend="reference")
        with pytest.raises(ValueError, match="indptr: request 1 has an empty KV history"):
            d.plan(i32([0, 1, 1]), i32([3]), i32([1, 0]), H_Q, H_KV, D, 4)
        with pytest.raises(ValueError, match="local_backend must be one of attnjit, reference"):
            ContextParallelDecode(ws, local_backend="vllm")
        with pytest.raises(ValueError, match="kv_layout must be 'NHD' or 'HND', got 'NDH'"):
            ContextParallelPrefill(ws, "NDH", local_backend="reference")
        with pytest.raises(ValueError, match="method must be one of all_gather, all_reduce"):
            ContextParallelDecode(ws, local_backend="reference", combine="tree")
        # a world of one: the wrapper is the reference itself
        o, lse = w.run(b.q, b.cache, return_lse=True)
        ref_o, _ = _expected("prefill_causal")
        assert (o - ref_o).abs().max().item() < 1e-12


@pytest.mark.nvcc
def test_the_context_parallel_catalog_compiles(tmp_path):
    """What each GPU rank dispatches (specs/context-parallel.toml): the cp_causal prefill in both families, the
    shard's decode and merge_states, built by nvcc without a GPU."""
    import attnjit
    from attnjit import jit
    from attnjit.specs import load_catalog

    specs = load_catalog(ROOT / "specs" / "context-parallel.toml")
    assert {s.variant.name for s in specs if s.variant} == {"cp_causal"} and len(specs) == 4
    results = jit.warm(specs, attnjit.Cache(tmp_path / "cache", layers=()))
    failed = [(r.job.label, r.error and r.error.first_error) for r in results if r.status != "built"]
    assert not failed, failed
