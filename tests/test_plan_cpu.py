"""plan() on a CPU workspace: argument checking (every bad input names the argument, and the request where there is
one) and which kernel family a plan runs on; the scheduler is in test_plan_split.py. No GPU is needed: plan()
validates and schedules anywhere; run() needs CUDA."""

from __future__ import annotations

import pytest
import torch

from attnjit.errors import NoGPUError
from attnjit.families import tiles_for
from attnjit.generator import PARAMS
from attnjit.ops.attention import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                                   BatchPrefillWithRaggedKVCacheWrapper)
from attnjit.specs import AttentionSpec
from tests.helpers import i32
from tests.plan_support import (SEED, SEED_KV_LENS, WORKSPACE_BYTES, check_work, decode_args, paged_args, ragged_args,
                                workspace)


# --- the seed batch plans -----------------------------------------------------------------------------------

def test_seed_batch_plans_for_paged_prefill():
    w = BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(**paged_args())
    plan = w._plan
    # 4 query rows x group 4 = 16 packed rows: a narrow batch, which runs on fa2 whatever the arch's default
    assert plan.spec == AttentionSpec(op="prefill", head_dim=128, page_size=4, dtype="fp16", mask="causal",
                                      group_size=4, family="fa2")
    assert (plan.batch_size, plan.total_q, plan.max_page) == (3, 8, 14)
    items = check_work(plan.work, qo_lens=[3, 1, 4], kv_lens=SEED_KV_LENS, group=4, tile=plan.work.tile,
                       causal=True, max_slots=10 ** 9, kv_bases=[0, 2, 3])
    assert sorted((it["req"], it["kv_end"]) for it in items) == [(0, 6), (1, 2), (2, 9)]
    d = w.last_plan
    assert d["split_kv"] is False and d["work_items"] == 3 and d["ctas"] == 3 * 8
    assert d["tile"] == tiles_for(plan.spec)[0].name  # 4 rows x group 4 = 16 packed rows: the narrow tile


def test_seed_batch_plans_for_decode_and_ragged():
    d = BatchDecodeWithPagedKVCacheWrapper(workspace())
    d.plan(**decode_args())
    assert d._plan.spec == AttentionSpec(op="decode", head_dim=128, page_size=4, dtype="bf16", group_size=4)
    check_work(d._plan.work, qo_lens=[1, 1, 1], kv_lens=SEED_KV_LENS, group=4, tile=d._plan.work.tile,
               causal=False, max_slots=10 ** 9, kv_bases=[0, 2, 3])
    r = BatchPrefillWithRaggedKVCacheWrapper(workspace())
    r.plan(**ragged_args())
    assert r._plan.spec == AttentionSpec(op="prefill", head_dim=64, dtype="fp16", kv="ragged", mask="causal",
                                         group_size=4, family="fa2")
    assert r._plan.total_kv == 17
    check_work(r._plan.work, qo_lens=[3, 1, 4], kv_lens=SEED_KV_LENS, group=4, tile=r._plan.work.tile,
               causal=True, max_slots=10 ** 9)


def test_hnd_layout_and_dtype_names_reach_the_spec():
    w = BatchPrefillWithPagedKVCacheWrapper(workspace(), kv_layout="HND")
    w.plan(**paged_args(q_data_type="bfloat16", causal=False))
    assert w._plan.spec == AttentionSpec(op="prefill", head_dim=128, page_size=4, dtype="bf16", layout="HND",
                                         group_size=4, family="fa2")


@pytest.mark.parametrize("make,args,run_args", [
    (BatchPrefillWithPagedKVCacheWrapper, paged_args, lambda: (torch.zeros(8, 32, 128, dtype=torch.float16),
                                                                torch.zeros(15, 2, 4, 8, 128, dtype=torch.float16))),
    (BatchDecodeWithPagedKVCacheWrapper, decode_args, lambda: (torch.zeros(3, 32, 128, dtype=torch.bfloat16),
                                                               torch.zeros(15, 2, 4, 8, 128, dtype=torch.bfloat16))),
    (BatchPrefillWithRaggedKVCacheWrapper, ragged_args, lambda: (torch.zeros(8, 32, 64, dtype=torch.float16),
                                                                 torch.zeros(17, 8, 64, dtype=torch.float16),
                                                                 torch.zeros(17, 8, 64, dtype=torch.float16))),
], ids=["paged", "decode", "ragged"])
def test_run_after_a_cpu_plan_raises_no_gpu(make, args, run_args):
    w = make(workspace())
    with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\)"):
        w.run(*run_args())
    w.plan(**args())
    with pytest.raises(NoGPUError, match="planned on cpu; kernels run on CUDA devices only"):
        w.run(*run_args())


# --- bad input: the error names the argument (and the request) --------------------------------------------------

I64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
F32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731

PAGED_BAD = {
    "int64 qo_indptr": (dict(qo_indptr=I64(SEED["qo_indptr"])), TypeError, r"qo_indptr must be int32, got torch.int64"),
    "int64 indices": (dict(paged_kv_indices=I64(SEED["paged_kv_indices"])), TypeError,
                      r"paged_kv_indices must be int32, got torch.int64"),
    "float last_page_len": (dict(paged_kv_last_page_len=F32([2, 2, 1])), TypeError,
                            r"paged_kv_last_page_len must be int32, got torch.float32"),
    "list metadata": (dict(paged_kv_indptr=None), TypeError, r"paged_kv_indptr must be a torch.Tensor"),
    "2-D metadata": (dict(qo_indptr=torch.tensor([[0, 3, 4, 8]], dtype=torch.int32)), ValueError,
                     r"qo_indptr must be 1-D"),
    "kv_indptr too short": (dict(paged_kv_indptr=[0, 2, 6]), ValueError,
                            r"paged_kv_indptr must have 4 elements, got 3"),
    "last_page_len too short": (dict(paged_kv_last_page_len=[2, 2]), ValueError,
                                r"paged_kv_last_page_len must have 3 elements, got 2"),
    "qo_indptr not monotone": (dict(qo_indptr=[0, 3, 2, 8]), ValueError,
                               r"qo_indptr must be non-decreasing: qo_indptr\[2\]=2 < qo_indptr\[1\]=3 \(request 1\)"),
    "kv_indptr not monotone": (dict(paged_kv_indptr=[0, 2, 1, 6]), ValueError,
                               r"paged_kv_indptr must be non-decreasing: .*\(request 1\)"),
    "qo_indptr[0] != 0": (dict(qo_indptr=[1, 3, 4, 8]), ValueError, r"qo_indptr\[0\] must be 0, got 1"),
    "kv_indptr[0] != 0": (dict(paged_kv_indptr=[1, 2, 3, 6]), ValueError, r"paged_kv_indptr\[0\] must be 0, got 1"),
    "last_page_len 0": (dict(paged_kv_last_page_len=[2, 0, 1]), ValueError,
                        r"paged_kv_last_page_len\[1\]=0 is outside 1..page_size=4 \(request 1"),
    "last_page_len > page_size": (dict(paged_kv_last_page_len=[2, 2, 5]), ValueError,
                                  r"paged_kv_last_page_len\[2\]=5 is outside 1..page_size=4 \(request 2"),
    "last_page_len without pages": (dict(paged_kv_indptr=[0, 2, 2, 5], paged_kv_last_page_len=[2, 3, 1],
                                         causal=False), ValueError,
                                    r"paged_kv_last_page_len\[1\]=3 but request 1 has no pages"),
    "negative page id": (dict(paged_kv_indices=[7, 2, 11, 3, -1, 6]), ValueError,
                         r"paged_kv_indices\[4\]=-1 is not a valid page id \(request 2\)"),
    "indptr past indices": (dict(paged_kv_indptr=[0, 2, 3, 7]), ValueError,
                            r"paged_kv_indices has 6 entries but paged_kv_indptr\[-1\]=7"),
    "causal qo_len > kv_len": (dict(qo_indptr=[0, 3, 6, 10]), ValueError,
                               r"qo_indptr: request 1 has 3 query rows but a KV length of 2 \(paged_kv_indptr/paged_kv_last_page_len\); "
                               r"with causal=True"),
    "H_q not a multiple of H_kv": (dict(num_qo_heads=30), ValueError,
                                   r"num_qo_heads=30 must be a multiple of num_kv_heads=8"),
    "zero kv heads": (dict(num_kv_heads=0), ValueError, r"num_kv_heads must be a positive int <= 1024, got 0"),
    "head_dim 96": (dict(head_dim_qk=96), ValueError,
                    r"head_dim_qk=96 is not supported: allowed head dims are 64, 128, 256"),
    "head_dim_vo differs": (dict(head_dim_vo=64), ValueError, r"head_dim_vo=64 must equal head_dim_qk=128"),
    "float32 q": (dict(q_data_type=torch.float32), TypeError,
                  r"q_data_type=torch.float32 is not supported: expected torch.float16 or torch.bfloat16"),
    "float32 kv": (dict(kv_data_type=torch.float32), TypeError, r"kv_data_type=torch.float32 is not supported"),
    "mixed q/kv": (dict(kv_data_type=torch.bfloat16), ValueError, r"kv_data_type=torch.bfloat16 must equal "
                                                                   r"q_data_type=torch.float16"),
    "page_size 0": (dict(page_size=0), ValueError, r"page_size=0 is not supported: expected an integer from 1 to 1024"),
    "page_size 1025": (dict(page_size=1025), ValueError, r"page_size=1025 is not supported"),
    "sm_scale negative": (dict(sm_scale=-1.0), ValueError, r"sm_scale must be a positive finite number, got -1.0"),
    "negative soft cap": (dict(logits_soft_cap=-30.0), ValueError, r"logits_soft_cap must be a positive finite number, got -30.0"),
    "bad window": (dict(window_left=-5), ValueError, r"window_left=-5 must be -1 \(no window\) or a non-negative int"),
    "unknown pos encoding": (dict(pos_encoding_mode="ROPE_NEOX"), NotImplementedError,
                             r"pos_encoding_mode='ROPE_NEOX' is not supported: expected one of NONE, ALIBI, ROPE_LLAMA"),
    "rope_theta negative": (dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=-1.0), ValueError,
                            r"rope_theta must be a positive finite number, got -1.0"),
    "rope_scale a string": (dict(pos_encoding_mode="ROPE_LLAMA", rope_scale="2"), TypeError,
                            r"rope_scale must be a number"),
    "sinks not a flag": (dict(sinks=torch.ones(32)), TypeError, r"sinks must be True or False"),
    "custom mask length": (dict(custom_mask=torch.ones(5, dtype=torch.bool)), ValueError,
                           r"custom_mask has 5 elements; the batch needs sum\(qo_len \* kv_len\) = 56"),
    "packed mask length": (dict(packed_custom_mask=torch.ones(3, dtype=torch.uint8)), ValueError,
                           r"packed_custom_mask has 3 bytes; the batch needs 9"),
}


@pytest.mark.parametrize("name", list(PAGED_BAD))
def test_paged_prefill_plan_rejects(name):
    changes, exc, pattern = PAGED_BAD[name]
    args = paged_args(**changes)
    if args.get("paged_kv_indptr") is None:
        args["paged_kv_indptr"] = SEED["paged_kv_indptr"]  # a plain list, not a tensor
    w = BatchPrefillWithPagedKVCacheWrapper(workspace())
    with pytest.raises(exc, match=pattern):
        w.plan(**args)
    assert w.last_plan is None, "a rejected plan() left a plan behind"


DECODE_BAD = {
    "int64 indptr": (dict(indptr=I64(SEED["paged_kv_indptr"])), TypeError, r"^indptr must be int32"),
    "float indices": (dict(indices=F32(SEED["paged_kv_indices"])), TypeError, r"^indices must be int32"),
    "last_page_len length": (dict(last_page_len=[2, 2, 1, 1]), ValueError, r"^last_page_len must have 3 elements"),
    "indptr not monotone": (dict(indptr=[0, 3, 2, 6]), ValueError, r"indptr must be non-decreasing.*\(request 1\)"),
    "last_page_len > page_size": (dict(last_page_len=[2, 9, 1]), ValueError,
                                  r"last_page_len\[1\]=9 is outside 1..page_size=4 \(request 1"),
    "negative page id": (dict(indices=[7, -2, 11, 3, 14, 6]), ValueError,
                         r"indices\[1\]=-2 is not a valid page id \(request 0\)"),
    "head_dim 96": (dict(head_dim=96), ValueError, r"head_dim=96 is not supported"),
    "group of 5 over 3": (dict(num_qo_heads=5, num_kv_heads=3), ValueError, r"num_qo_heads=5 must be a multiple"),
    "float32": (dict(q_data_type="float32"), TypeError, r"q_data_type='float32' is not supported"),
    "page_size 2048": (dict(page_size=2048), ValueError, r"page_size=2048"),
}


@pytest.mark.parametrize("name", list(DECODE_BAD))
def test_decode_plan_rejects(name):
    changes, exc, pattern = DECODE_BAD[name]
    with pytest.raises(exc, match=pattern):
        BatchDecodeWithPagedKVCacheWrapper(workspace()).plan(**decode_args(**changes))


RAGGED_BAD = {
    "int64 kv_indptr": (dict(kv_indptr=I64([0, 6, 8, 17])), TypeError, r"kv_indptr must be int32"),
    "kv_indptr length": (dict(kv_indptr=[0, 6, 17]), ValueError, r"kv_indptr must have 4 elements, got 3"),
    "kv_indptr not monotone": (dict(kv_indptr=[0, 6, 5, 17]), ValueError,
                               r"kv_indptr must be non-decreasing: kv_indptr\[2\]=5 < kv_indptr\[1\]=6 \(request 1\)"),
    "causal qo_len > kv_len": (dict(kv_indptr=[0, 6, 8, 11]), ValueError,
                               r"request 2 has 4 query rows but a KV length of 3"),
    "head_dim 96": (dict(head_dim_qk=96), ValueError, r"head_dim_qk=96 is not supported"),
    "float32": (dict(q_data_type=torch.float32), TypeError, r"q_data_type=torch.float32"),
}


@pytest.mark.parametrize("name", list(RAGGED_BAD))
def test_ragged_plan_rejects(name):
    changes, exc, pattern = RAGGED_BAD[name]
    with pytest.raises(exc, match=pattern):
        BatchPrefillWithRaggedKVCacheWrapper(workspace()).plan(**ragged_args(**changes))


def test_non_causal_allows_more_queries_than_keys():
    w = BatchPrefillWithRaggedKVCacheWrapper(workspace())
    w.plan(**ragged_args(kv_indptr=[0, 6, 8, 11], causal=False))
    assert w._plan.total_kv == 11


def test_constructor_rejects_bad_workspaces_and_layouts():
    with pytest.raises(ValueError, match="float_workspace_buffer must be a contiguous 1-D tensor"):
        BatchPrefillWithPagedKVCacheWrapper(torch.empty(4, 4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="float_workspace_buffer must be a torch.Tensor"):
        BatchDecodeWithPagedKVCacheWrapper(bytearray(16))
    with pytest.raises(ValueError, match="kv_layout='NDH' is not supported"):
        BatchPrefillWithPagedKVCacheWrapper(workspace(), kv_layout="NDH")
    with pytest.raises(ValueError, match="kv_layout='HND' is not supported for ragged KV"):
        BatchPrefillWithRaggedKVCacheWrapper(workspace(), kv_layout="HND")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a wrapper over a CUDA workspace needs a CUDA device")
def test_host_metadata_is_accepted_by_a_cuda_wrapper():
    """As in FlashInfer, plan() takes its metadata on the host too (it reads it on the host anyway); the page ids
    travel to the device with the plan. (tests/gpu/test_attention.py runs such a plan against the reference.)"""
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"))
    w.plan(**paged_args())
    assert w.last_plan["work_items"] == 3


# --- kernel families: which one a plan runs on ------------------------------------------------------------------

def test_plan_picks_the_family_by_arch_batch_and_backend():
    """On sm_90a a wide prefill batch runs on sm90 and a narrow one (decode-like rows) on fa2; backend= forces one
    (FlashInfer's names: 'fa3' is attnjit's sm90); decode runs on fa2 whatever the backend; the record names it."""
    wide = dict(qo_indptr=i32([0, 300]), paged_kv_indptr=i32([0, 19]), paged_kv_indices=i32(list(range(19))),
                paged_kv_last_page_len=i32([12]), num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, page_size=16,
                causal=True, q_data_type=torch.bfloat16)
    w = BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(**wide)
    assert w._plan.spec.family == "sm90" and w.last_plan["family"] == "sm90"
    assert w.last_plan["tile"] == tiles_for(w._plan.spec)[0].name
    assert w._plan.attn_values[PARAMS["attention"].index["work_count"]] == 0  # no GPU: pointers stay 0
    w.plan(**paged_args())                    # 16 packed rows: fa2's narrow tile
    assert w._plan.spec.family == "fa2"
    for backend, family in (("fa2", "fa2"), ("fa3", "sm90"), ("sm90", "sm90"), ("auto", "sm90")):
        f = BatchPrefillWithPagedKVCacheWrapper(workspace(), backend=backend)
        f.plan(**wide)
        assert f._plan.spec.family == family, backend
    f = BatchPrefillWithPagedKVCacheWrapper(workspace(), backend="fa3")
    f.plan(**paged_args())                    # forced: even a narrow batch
    assert f._plan.spec.family == "sm90"
    d = BatchDecodeWithPagedKVCacheWrapper(workspace(), backend="fa3")
    d.plan(**decode_args())
    assert d._plan.spec.family == "fa2"
    for bad in ("fa4", "cudnn", None, 3):
        with pytest.raises(ValueError, match="backend=.* is not supported"):
            BatchPrefillWithPagedKVCacheWrapper(workspace(), backend=bad)


def test_sm90_is_not_chosen_off_hopper(monkeypatch):
    monkeypatch.setenv("ATTNJIT_ARCH", "sm_80")
    w = BatchPrefillWithPagedKVCacheWrapper(workspace())
    w.plan(qo_indptr=i32([0, 300]), paged_kv_indptr=i32([0, 19]), paged_kv_indices=i32(list(range(19))),
           paged_kv_last_page_len=i32([12]), num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, page_size=16,
           causal=True, q_data_type=torch.bfloat16)
    assert w._plan.spec.family == "fa2" and w._plan.spec.arch == "sm_80"
    f = BatchPrefillWithPagedKVCacheWrapper(workspace(), backend="fa3")
    with pytest.raises(ValueError, match="backend='fa3' cannot run this plan: the sm90 family needs arch sm_90a"):
        f.plan(**paged_args())
