"""FP8 KV cache on the CPU (issue 14 item 1): the element-type table, specs and their keys, real nvcc compiles of
the fp8 kernels for sm_90a and sm_80 (the sm_90a decode kernel converts with the hardware F2FP and does not spill),
the sm_80 bit-trick conversion checked exhaustively against torch, plan()/run() validation of dtypes and scales,
the reference's dequantization and the family fallback (sm90 -> fa2)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import attnjit
from attnjit import dtypes, reference
from attnjit.generator import render
from attnjit.specs import AttentionSpec, SpecError, load_catalog

from .helpers import i32
from .cpu_support import assert_no_spills, compile_kernel

DECODE = dict(op="decode", head_dim=128, page_size=16, group_size=4)
BF16_Q_E4M3_DECODE = AttentionSpec(dtype_q="bf16", dtype_kv="e4m3", arch="sm_90a", **DECODE)


# --- the element-type table and specs ---------------------------------------------------------------------------

@pytest.mark.parametrize("alias,name", [("e4m3", "e4m3"), ("float8_e4m3fn", "e4m3"), ("FP8_E4M3", "e4m3"),
                                        ("torch.float8_e4m3fn", "e4m3"), (torch.float8_e4m3fn, "e4m3"),
                                        ("e5m2", "e5m2"), ("fp8_e5m2", "e5m2"), (torch.float8_e5m2, "e5m2"),
                                        ("half", "fp16"), (torch.bfloat16, "bf16")])
def test_aliases_and_torch_dtypes_map_to_one_name(alias, name):
    t = dtypes.lookup(alias)
    assert t is not None and t.name == name
    assert AttentionSpec(dtype_q="bf16", dtype_kv=alias if t.is_fp8 else "bf16", **DECODE).dtype_kv == \
        (name if t.is_fp8 else "bf16")


def test_the_table_is_consistent_with_torch():
    for t in dtypes.TYPES.values():
        assert t.torch.itemsize == t.bytes and dtypes.lookup(t.torch) is t
        assert render(AttentionSpec(op="append_kv", head_dim=128, page_size=16, dtype_kv=t.name)).source.count(
            f"using T = {t.ctype};") == 1


def test_fp8_kv_specs_name_their_type_and_differ_from_16_bit_ones():
    plain = AttentionSpec(dtype="bf16", **DECODE)
    e4 = AttentionSpec(dtype_q="bf16", dtype_kv="e4m3", **DECODE)
    e5 = AttentionSpec(dtype_q="bf16", dtype_kv="float8_e5m2", **DECODE)
    assert len({plain, e4, e5}) == 3 and e4.dtype_o == "bf16"
    assert '"dtype_kv":"e4m3"' in e4.canonical() and "-kve4m3-" in e4.short_name()
    assert AttentionSpec.parse(e5.as_flags()) == e5
    assert len({render(s).source for s in (plain, e4, e5)}) == 3
    assert "using TKV = __nv_fp8_e4m3;" in render(e4).source


@pytest.mark.parametrize("kwargs,field,message", [
    (dict(dtype_q="e4m3", dtype_kv="e4m3"), "dtype_q", "expected one of fp16, bf16"),
    (dict(dtype_q="fp16", dtype_kv="bf16"), "dtype_kv", "must equal dtype_q='fp16' or be an fp8 type"),
    (dict(dtype_q="bf16", dtype_kv="e4m3", dtype_o="e4m3"), "dtype_o", "expected one of fp16, bf16"),
    (dict(dtype_q="bf16", dtype_kv="fp8"), "dtype_kv", "expected one of fp16, bf16, e4m3, e5m2"),
])
def test_bad_fp8_specs_name_the_field(kwargs, field, message):
    with pytest.raises(SpecError, match=re.escape(message)) as exc:
        AttentionSpec(**DECODE, **kwargs)
    assert exc.value.field == field


def test_fp8_prefill_defaults_to_sm90_but_a_key_transform_past_fp16_to_fa2():
    from attnjit import variants

    prefill = dict(op="prefill", head_dim=128, page_size=16, dtype_q="bf16", mask="causal", arch="sm_90a")
    assert AttentionSpec(**prefill, dtype_kv="bf16").family == "sm90"
    for kv in ("e4m3", "e5m2"):
        assert AttentionSpec(**prefill, dtype_kv=kv).family == "sm90"
    # a rotation of e5m2's range (57344) overflows the sm90 family's fp16 K tile; e4m3's (448) does not
    assert AttentionSpec(**prefill, dtype_kv="e4m3", variant=variants.ROPE_LLAMA).family == "sm90"
    assert AttentionSpec(**prefill, dtype_kv="e5m2", variant=variants.ROPE_LLAMA).family == "fa2"
    with pytest.raises(SpecError, match="cannot hold a key transform of an e5m2 cache"):
        AttentionSpec(**prefill, dtype_kv="e5m2", variant=variants.ROPE_LLAMA, family="sm90")
    # a user key transform may scale past fp16 (448 x 147 > 65504): fa2, which transforms in bf16
    gain = attnjit.Variant("kgain_test", params={"g": float}, key_transform="return k * g;")
    assert AttentionSpec(**prefill, dtype_kv="e4m3", variant=gain).family == "fa2"
    assert AttentionSpec(**prefill, dtype_kv="bf16", variant=gain).family == "sm90"
    assert AttentionSpec(**prefill, dtype_kv="e4m3", variant=variants.compose(variants.ROPE_LLAMA,
                                                                              variants.SOFTCAP)).family == "sm90"


def test_a_catalog_names_fp8_kv(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[[spec]]\nop = ["decode", "prefill"]\nhead_dim = 128\npage_size = 16\ndtype_q = "bf16"\n'
                    'dtype_kv = ["e4m3", "e5m2"]\ngroup_size = 4\n')
    specs = load_catalog(path)
    # prefill: sm90, and fa2 for the decode-like batches plan() moves there (families.dispatchable)
    assert {(s.op, s.dtype_kv, s.family) for s in specs} == {(op, kv, fam) for kv in ("e4m3", "e5m2")
                                                             for op, fam in (("decode", "fa2"), ("prefill", "sm90"),
                                                                             ("prefill", "fa2"))}


# --- compiles ------------------------------------------------------------------------------------------------

def _spilled(log: str) -> int:
    """Bytes of spill stores over the module's kernels."""
    return sum(int(a) for a in re.findall(r"(\d+) bytes spill stores", log))


@pytest.mark.nvcc
def test_sm90a_fp8_decode_uses_the_hardware_convert_and_does_not_spill(tmp_path):
    log, sass = compile_kernel(tmp_path, BF16_Q_E4M3_DECODE, sass=True)
    assert_no_spills(log, sass)
    assert "F2FP.F16.E4M3.UNPACK_B" in sass  # cvt.rn.f16x2.e4m3x2
    assert "HMUL2" not in sass               # not the sm_80 bit path


@pytest.mark.nvcc
def test_bf16_q_over_fp8_multiplies_in_fp16_from_registers(tmp_path):
    """The fp8 bytes go from the staged tile into fp16 mma operands (fa2/fp8_frags.cuh): every tensor-core op of a
    bf16-q fp8 decode is fp16, the high half of an ldmatrix word is converted in place (R.H1, no shift), and the
    K and V fragments come from ldmatrix (plain and transposed) on the staged bytes."""
    _, sass = compile_kernel(tmp_path, BF16_Q_E4M3_DECODE, sass=True)
    hmma = re.findall(r"HMMA\.16816\.F32(\.BF16)?", sass)
    assert hmma and not any(hmma), "a bf16 mma in the fp8 kernel"
    assert re.search(r"F2FP\.F16\.E4M3\.UNPACK_B R\d+, R\d+\.H1", sass)
    assert "LDSM.16.MT88.4" in sass and "LDSM.16.M88.4" in sass


def test_fp8_tiles_convert_in_registers_unless_a_key_transform():
    from attnjit import variants
    from attnjit.families import fa2

    plain = AttentionSpec(dtype_q="bf16", dtype_kv="e4m3", arch="sm_90a", **DECODE)
    assert all(t.fp8_in_regs and t.kv_bytes == 1 for t in fa2.tiles(plain))
    # its own deep tile for split batches (eight warps, one CTA an SM: fa2.deep_fp8_decode_tile)
    assert [(t.tag, t.warps_kv, t.min_blocks) for t in fa2.tiles(plain)] == [("", 4, 2), ("deep", 8, 1)]
    rope = plain.replace(variant=variants.ROPE_LLAMA)  # a key transform rewrites K in shared memory
    assert fa2.tiles(rope) and not any(t.fp8_in_regs for t in fa2.tiles(rope))
    assert [t.tag for t in fa2.tiles(rope)] == [""]
    sixteen = AttentionSpec(dtype="bf16", arch="sm_90a", **DECODE)
    assert not any(t.fp8_in_regs for t in fa2.tiles(sixteen))
    # converted in shared memory, the 16-bit tile comes on top (and the q row scales go)
    t_regs, t_smem = fa2.tiles(plain)[0], fa2.tiles(rope)[0]
    assert t_smem.smem - t_regs.smem == t_regs.cta_kv * 128 * 2 - 128


@pytest.mark.parametrize("head_dim,row_bytes", [(64, 80), (128, 128), (256, 256)])
def test_fp8_stages_hold_128_byte_aligned_rows_where_rows_are_128_byte_multiples(head_dim, row_bytes):
    """The fa2 family stages an fp8 cache as stored: rows of 128 and 256 bytes swizzled (chunk c of row r at
    c ^ (r & 7), fa2/traits.cuh stage8_offset), so each 128-byte global row lands in one 128-byte shared segment;
    64-byte rows padded by 16. With 144-byte padded rows every cp.async of the fp8 decode asked L2 for 24 sectors where
    16 hold its bytes (RESULTS.md run 102), and the decode read 8-10% fewer fp8 bytes a second. Tile.smem is held to
    the traits' SMEM_BYTES by the template's static_assert, so this pins the traits' row size."""
    from attnjit.families import fa2

    spec = AttentionSpec(op="decode", head_dim=head_dim, page_size=16, dtype_q="bf16", dtype_kv="e4m3",
                         group_size=4, arch="sm_90a")
    t = fa2.tiles(spec)[0]
    b16 = fa2.tiles(spec.replace(dtype_kv="bf16"))[0]
    assert (t.cta_q, t.cta_kv, t.warps_kv) == (b16.cta_q, b16.cta_kv, b16.warps_kv)
    q_tile, qscale = t.cta_q * head_dim * 2, -(-t.cta_q * 4 // 128) * 128
    pages = -(-2 * t.stages * fa2.pages_per_tile_of(t.cta_kv, 16) * 4 // 128) * 128
    merge = t.warps_kv * t.cta_q * (head_dim + 1) * 4
    assert t.smem == q_tile + pages + qscale + max(2 * t.stages * t.cta_kv * row_bytes, merge)


@pytest.mark.nvcc
@pytest.mark.parametrize("spec", [
    AttentionSpec(dtype_q="fp16", dtype_kv="e5m2", arch="sm_80", **DECODE),
    AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype_q="bf16", dtype_kv="e4m3", mask="causal",
                  group_size=4, arch="sm_90a", family="fa2"),
    AttentionSpec(op="prefill", head_dim=64, kv="ragged", dtype_q="bf16", dtype_kv="e4m3", mask="causal",
                  group_size=4, arch="sm_80"),
    AttentionSpec(op="append_kv", head_dim=128, page_size=16, dtype_kv="e4m3", arch="sm_90a"),
    AttentionSpec(op="append_kv", head_dim=64, page_size=5, dtype_kv="e5m2", layout="HND", arch="sm_80"),
], ids=lambda s: s.short_name())
def test_fp8_kernels_compile_without_spills(tmp_path, spec):
    """Decode and append do not spill. Prefill's wide tile runs at 255 registers: its 16-bit twin spills 4 bytes at
    head_dim 128, the fp8 one at most 8 (reloaded in the loop: 40 bytes of spill loads; the narrow tile none)."""
    log, sass = compile_kernel(tmp_path, spec, sass=True)
    if spec.op == "prefill":
        assert _spilled(log) <= 8, log
    else:
        assert_no_spills(log, sass)
    if spec.op != "append_kv":
        assert ("F2FP" in sass and "E4M3" in sass) if spec.arch == "sm_90a" else "E4M3" not in sass


@pytest.mark.nvcc
@pytest.mark.parametrize("spec", [
    AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype_q="bf16", dtype_kv="e4m3", mask="causal",
                  group_size=4, arch="sm_90a"),
    AttentionSpec(op="prefill", head_dim=64, page_size=1, dtype_q="fp16", dtype_kv="e5m2", group_size=1,
                  arch="sm_90a"),
    AttentionSpec(op="prefill", head_dim=256, kv="ragged", dtype_q="bf16", dtype_kv="e5m2", mask="causal",
                  group_size=2, arch="sm_90a"),
    AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype_q="bf16", dtype_kv="e4m3", mask="causal",
                  group_size=4, arch="sm_90a", tile="kv128q1"),
], ids=lambda s: s.short_name() + (f"-{s.tile}" if s.tile else ""))
def test_sm90_fp8_prefill_converts_in_the_producer_and_multiplies_in_fp16(tmp_path, spec):
    """The sm90 family over an fp8 cache: no spills, every wgmma fp16 (a bf16 q is converted once per item), and
    the hardware fp8 -> fp16 convert (the producer converts each tile in place, sm90/producer.cuh)."""
    assert spec.family == "sm90"
    log, sass = compile_kernel(tmp_path, spec, sass=True)
    assert_no_spills(log, sass)
    hgmma = re.findall(r"HGMMA\.64x\d+x16\.F32(\.BF16)?", sass)
    assert hgmma and not any(hgmma), "a bf16 wgmma in the fp8 kernel"
    assert f"F2FP.F16.{spec.dtype_kv.upper()}.UNPACK_B" in sass


def _bit_trick(code: int, fmt: str) -> float:
    """attnjit/fp8.cuh's sm_80 conversion of one fp8 byte, in Python: the same bits, then the fp16 multiply."""
    import numpy as np

    s = code << 8  # __byte_perm(w, 0, 0x1404): the byte is the high byte of a 16-bit lane
    bits = s if fmt == "e5m2" else (s & 0x8000) | ((s & 0x7f00) >> 1)
    h = np.array([bits], dtype=np.uint16).view(np.float16)[0]
    return float(h) if fmt == "e5m2" else float(h * np.float16(256.0))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_the_sm80_bit_conversion_is_exact_for_every_code(fmt):
    dt = dtypes.of(fmt).torch
    for code in range(256):
        want = torch.tensor([code], dtype=torch.uint8).view(dt).double().item()
        got = _bit_trick(code, fmt)
        if math.isnan(want):  # e4m3's NaN (0x7f, 0xff) reads as +-480 on the bit path (fp8.cuh); e5m2's stays NaN
            assert got == (480.0 if code < 128 else -480.0) if fmt == "e4m3" else math.isnan(got), (fmt, code, got)
        else:
            assert got == want, (fmt, code, got, want)


# --- plan() and run() ------------------------------------------------------------------------------------------

H_Q, H_KV, D, PS = 32, 8, 128, 16
KV_INDPTR, KV_LAST = [0, 2, 5], [3, 16]


def _decode(kv_data_type="e4m3", q_data_type=torch.bfloat16, **kw):
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), **kw)
    w.plan(i32(KV_INDPTR), i32(range(5)), i32(KV_LAST), H_Q, H_KV, D, PS, q_data_type=q_data_type,
           kv_data_type=kv_data_type)
    return w


def _inputs(kv_dtype=torch.float8_e4m3fn):
    q = torch.randn(2, H_Q, D).to(torch.bfloat16)
    cache = torch.randn(5, 2, PS, H_KV, D).to(kv_dtype)
    return q, cache


def test_plan_takes_fp8_kv_by_name_or_dtype_and_records_the_family():
    for kv in ("e4m3", torch.float8_e4m3fn, "float8_e4m3fn", "fp8_e5m2", torch.float8_e5m2):
        w = _decode(kv)
        assert w._plan.spec.dtype_kv == dtypes.lookup(kv).name and w.last_plan["family"] == "fa2"
    p = attnjit.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    p.plan(i32([0, 19, 35]), i32(KV_INDPTR), i32(range(5)), i32(KV_LAST), H_Q, H_KV, D, PS, causal=True,
           q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
    assert p.last_plan["family"] == "sm90"  # the sm90 family reads fp8 too (its producer converts it)
    p.plan(i32([0, 19, 35]), i32(KV_INDPTR), i32(range(5)), i32(KV_LAST), H_Q, H_KV, D, PS, causal=True,
           q_data_type=torch.bfloat16)
    assert p.last_plan["family"] == "sm90"
    f = attnjit.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend="fa3")
    f.plan(i32([0, 19, 35]), i32(KV_INDPTR), i32(range(5)), i32(KV_LAST), H_Q, H_KV, D, PS, causal=True,
           q_data_type=torch.bfloat16, kv_data_type="e4m3")
    assert f.last_plan["family"] == "sm90"
    with pytest.raises(ValueError, match=r"backend='fa3' cannot run this plan: .*key transform of an e5m2 cache"):
        f.plan(i32([0, 19, 35]), i32(KV_INDPTR), i32(range(5)), i32(KV_LAST), H_Q, H_KV, D, PS, causal=True,
               q_data_type=torch.bfloat16, kv_data_type="e5m2", pos_encoding_mode="ROPE_LLAMA")


@pytest.mark.parametrize("q,kv,exc,match", [
    (torch.float8_e4m3fn, "e4m3", TypeError, r"q_data_type=torch.float8_e4m3fn is not supported"),
    (torch.bfloat16, torch.float16, ValueError, r"kv_data_type=torch.float16 must equal q_data_type=torch.bfloat16 "
                                                r"or be an fp8 type"),
    (torch.bfloat16, "int8", TypeError, r"kv_data_type='int8' is not supported: expected .*float8_e4m3fn"),
])
def test_plan_rejects_bad_dtype_pairs(q, kv, exc, match):
    with pytest.raises(exc, match=match):
        _decode(kv, q)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("value,exc,match", [
    (float("nan"), ValueError, "positive finite"), (float("inf"), ValueError, "positive finite"),
    (0.0, ValueError, "positive finite"), (-1.0, ValueError, "positive finite"), (True, TypeError, "got bool"),
    (np.bool_(True), TypeError, "got bool"),
    ("1", TypeError, "got str"), (torch.ones(H_KV, dtype=torch.float16), TypeError, "float32 tensor"),
    (torch.ones(H_KV + 1), ValueError, r"shape \[8\]"), (torch.ones(1, H_KV), ValueError, r"shape \[8\]"),
    (torch.ones(2 * H_KV)[::2], ValueError, "contiguous"),
    pytest.param(10 ** 400, ValueError, "finite number, got an int of 1329 bits", id="10**400"),
    (1e39, ValueError, "float32 range"),
    (1e-39, ValueError, "float32 range"),
])
def test_run_rejects_bad_scales_by_name(name, value, exc, match):
    w = _decode()
    q, cache = _inputs()
    with pytest.raises(exc, match=rf"^{name} .*{match}"):
        w.run(q, cache, **{name: value})


def test_a_float_k_scale_must_keep_the_logit_scale_in_float32():
    """k_scale multiplies sm_scale * log2(e) in the float32 parameter struct: the product must fit it too."""
    w = _decode()
    q, cache = _inputs()
    with pytest.raises(ValueError, match=r"^k_scale=5e-38 times the plan's sm_scale \* log2\(e\) .* float32"):
        w.run(q, cache, k_scale=5e-38)


def test_good_scales_fill_the_parameter_struct():
    w = _decode()
    q, cache = _inputs()
    vals, idx = w._plan.attn_values, w._plan.layout.index
    base = w._plan.sm_scale_log2
    with pytest.raises(attnjit.NoGPUError):
        w.run(q, cache, k_scale=0.5, v_scale=0.25)
    assert vals[idx["sm_scale_log2"]] == pytest.approx(base * 0.5) and vals[idx["scale_v_value"]] == 0.25
    with pytest.raises(attnjit.NoGPUError):
        w.run(q, cache, k_scale=np.float32(0.25), v_scale=np.int64(2))   # numpy scalars, as plan() takes them
    assert vals[idx["sm_scale_log2"]] == pytest.approx(base * 0.25) and vals[idx["scale_v_value"]] == 2.0
    ks, vs = torch.full((H_KV,), 0.5), torch.full((H_KV,), 2.0)
    with pytest.raises(attnjit.NoGPUError):
        w.run(q, cache, k_scale=ks, v_scale=vs)
    assert vals[idx["scale_k"]] == ks.data_ptr() and vals[idx["scale_v"]] == vs.data_ptr()
    assert vals[idx["sm_scale_log2"]] == base and vals[idx["scale_v_value"]] == 1.0
    with pytest.raises(attnjit.NoGPUError):
        w.run(q, cache)   # no scales: the plan's again
    assert (vals[idx["scale_k"]], vals[idx["scale_v"]], vals[idx["sm_scale_log2"]]) == (0, 0, base)


def test_a_16_bit_plan_takes_float_scales_but_not_tensors():
    w = _decode(None)
    q, cache = _inputs(torch.bfloat16)
    with pytest.raises(attnjit.NoGPUError):
        w.run(q, cache, k_scale=0.5, v_scale=2.0)   # as FlashInfer: k_scale in the logit scale, out *= v_scale
    assert w._plan.attn_values[w._plan.layout.index["sm_scale_log2"]] == pytest.approx(w._plan.sm_scale_log2 * 0.5)
    with pytest.raises(ValueError, match=r"v_scale: per-KV-head scale tensors need an fp8 KV plan"):
        w.run(q, cache, v_scale=torch.ones(H_KV))


def test_the_cache_must_have_the_plans_kv_type():
    w = _decode("e4m3")
    q, _ = _inputs()
    for dt in (torch.float8_e5m2, torch.bfloat16):
        with pytest.raises(ValueError, match=r"paged_kv_cache must be torch.float8_e4m3fn"):
            w.run(q, _inputs(dt)[1])


def test_append_into_an_fp8_cache_takes_its_type_only():
    cache = torch.zeros(4, 2, PS, H_KV, D, dtype=torch.float8_e4m3fn)
    k = torch.randn(3, H_KV, D)
    args = (i32([0, 0, 0]), i32([0, 1, 2]), cache, i32([1]), i32([0, 1]), i32([3]))
    for dt in (torch.bfloat16, torch.float8_e5m2):
        with pytest.raises(TypeError, match=r"append_key must be torch.float8_e4m3fn \(the cache's type\).*quantized"):
            attnjit.append_paged_kv_cache(k.to(dt), k.to(dt), *args)
    with pytest.raises(attnjit.NoGPUError):
        attnjit.append_paged_kv_cache(k.to(cache.dtype), k.to(cache.dtype), *args)


# --- the reference ---------------------------------------------------------------------------------------------

def test_the_reference_dequantizes_with_float_and_per_head_scales():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 8, 64, generator=gen)
    k8 = (torch.randn(40, 2, 64, generator=gen) * 30).to(torch.float8_e4m3fn)
    v8 = (torch.randn(40, 2, 64, generator=gen) * 30).to(torch.float8_e5m2)
    ks, vs = torch.tensor([0.02, 0.05]), 0.03
    o, lse = reference.attention(q, k8, v8, causal=True, k_scale=ks, v_scale=vs)
    k, v = k8.double() * ks.double().reshape(1, 2, 1), v8.double() * vs
    o_ref, lse_ref = reference.attention(q, k, v, causal=True)
    assert torch.allclose(o, o_ref) and torch.allclose(lse, lse_ref)


def _mma_a_fed_by_moves(sass: str, window: int = 12) -> int:
    """How many HMMA of the SASS read an A operand (4 registers from the one named) that a MOV / IMAD.MOV wrote
    within the ``window`` instructions before it: a fragment copied into place for that mma."""
    from benchmarks import sm90_sass as ss

    ins = [text for _, text, _ in ss.instructions(sass)]
    fed = 0
    for i, text in enumerate(ins):
        m = re.match(r"(?:@!?U?P\w+\s+)?HMMA\.16816\.F32\S*\s+R\d+,\s*R(\d+)", text)
        if not m:
            continue
        regs = {f"R{int(m.group(1)) + k}" for k in range(4)}
        for prev in ins[max(0, i - window):i]:
            mv = re.match(r"(?:@!?U?P\w+\s+)?(?:MOV|IMAD\.MOV\.U32)\s+(R\d+),", prev)
            if mv and mv.group(1) in regs:
                fed += 1
                break
    return fed


@pytest.mark.nvcc
@pytest.mark.parametrize("kv", ["e4m3", "bf16"])
def test_decode_mma_reads_q_fragments_in_place(kv):
    """The fa2 decode module (bf16 q, page 16, group 4): no mma's Q operand is copied into place before it. The fp8
    order's fragments (two rows' words) held in load order made ptxas copy each into four aligned registers before
    every mma, 15 of them in the module (8 moves per 16 dims per warp, RESULTS.md run 98); q_frags_as_quads
    re-lays them once per work item. The bf16 kernel's ldmatrix fragments never needed it."""
    from benchmarks import sm90_sass as ss

    spec = AttentionSpec(op="decode", head_dim=128, page_size=16, dtype_q="bf16", dtype_kv=kv, group_size=4,
                         arch="sm_90a")
    sass = ss._module_sass(spec)
    assert "HMMA.16816" in sass
    assert _mma_a_fed_by_moves(sass) == 0


def test_split_scale_gives_torch_ops_a_float_and_refuses_bools():
    """Under torch.compile the scales go to torch.ops as float?, which would take a bool as 1.0."""
    from attnjit.ops._running import split_scale

    assert split_scale(np.float32(2.0)) == (2.0, None) and type(split_scale(np.int64(3))[0]) is float
    t = torch.ones(H_KV)
    assert split_scale(t) == (None, t) and split_scale(None) == (None, None)
    for bad in (True, np.bool_(False)):
        with pytest.raises(TypeError, match="got bool"):
            split_scale(bad)
