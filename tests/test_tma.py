"""The sm90 family's TMA copies on the host: which tensors qualify, the descriptors' arguments, the parameter
struct's fields, the knob, and (nvcc) the kernels that issue them. On the GPU the correctness matrix runs the same
kernels with and without them (tests/gpu/test_attention.py)."""

from __future__ import annotations

import re

import pytest
import torch

from attnjit import tma
from attnjit.families import sm90
from attnjit.generator import attention_layout, render
from attnjit.specs import AttentionSpec

from .cpu_support import assert_no_spills, compile_kernel


def _spec(**kw) -> AttentionSpec:
    base = dict(op="prefill", head_dim=128, dtype="bf16", mask="causal", group_size=4, family="sm90",
                arch="sm_90a", page_size=16)
    base.update(kw)
    return AttentionSpec(**base)


def test_describe_takes_contiguous_tensors_and_refuses_what_tma_cannot_read():
    ok = tma.describe(9, 2, 0x1000, (128, 8, 4096), (128, 1024), (64, 1, 128))
    assert isinstance(ok, tma.MapArgs) and ok.strides == (256, 2048) and ok.dims == (128, 8, 4096)
    assert "16-byte" in tma.describe(9, 2, 0x1008, (128, 8, 64), (128, 1024), (64, 1, 64))
    assert "multiple of 16" in tma.describe(9, 2, 0x1000, (128, 8, 64), (128, 1028), (64, 1, 64))  # odd token stride
    assert "nest" in tma.describe(9, 2, 0x1000, (128, 8, 64), (1024, 128), (64, 1, 64))  # heads outside tokens
    assert "box" in tma.describe(9, 2, 0x1000, (128, 8, 16), (128, 1024), (64, 1, 128))  # a box past a small dim
    assert "dims" in tma.describe(9, 2, 0x1000, (128, 8, 0), (128, 1024), (64, 1, 1))


def test_kv_args_follow_the_cache_layouts():
    kw = dict(rows=10, page_size=16, heads=8, head_dim=128, box_rows=16)
    nhd = tma.kv_args(0x2000, "bf16", paged=True, hnd=False, stride0=16 * 8 * 128, stride1=8 * 128, **kw)
    assert nhd.dims == (128, 8, 16, 10) and nhd.strides == (256, 2048, 32768) and nhd.box == (64, 1, 16, 1)
    hnd = tma.kv_args(0x2000, "fp16", paged=True, hnd=True, stride0=16 * 8 * 128, stride1=16 * 128, **kw)
    assert hnd.dims == (128, 16, 8, 10) and hnd.strides == (256, 4096, 32768) and hnd.box == (64, 16, 1, 1)
    assert hnd.dtype == 6 and nhd.dtype == 9
    # a [pages, 2, page, H, D] cache's k view: pages twice as far apart, still nesting
    both = tma.kv_args(0x2000, "bf16", paged=True, hnd=False, stride0=2 * 16 * 8 * 128, stride1=8 * 128, **kw)
    assert both.strides[-1] == 2 * 32768
    ragged = tma.kv_args(0x2000, "bf16", paged=False, hnd=False, rows=5000, page_size=0, heads=8, head_dim=128,
                         stride0=8 * 128, stride1=128, box_rows=128)
    assert ragged.dims == (128, 8, 5000) and ragged.box == (64, 1, 128)
    huge = tma.kv_args(0x2000, "bf16", paged=False, hnd=False, rows=2 ** 31, page_size=0, heads=1, head_dim=128,
                       stride0=128, stride1=128, box_rows=128)
    assert "int32" in huge  # the kernel's token coordinate: such a cache is copied by cp.async (int64 offsets)


def test_interleaved_kv_args_bring_a_whole_page_in_one_box():
    """The 5-D map of interleaved tiles (sm90.kv_interleaved): {64, slot % 8, head x column block, slot / 8, page},
    a box a page with all of its column blocks; refused (cp.async copies the tile, same layout) where a cache's
    slots or pages overlap, or the tile is not whole pages of 8k tokens."""
    kw = dict(rows=10, page_size=16, heads=8, head_dim=128, box_rows=16, interleaved=True)
    m = tma.kv_args(0x2000, "bf16", paged=True, hnd=False, stride0=16 * 8 * 128, stride1=8 * 128, **kw)
    assert m.dims == (64, 8, 16, 2, 10) and m.strides == (2048, 128, 16384, 32768) and m.box == (64, 8, 2, 2, 1)
    # pages padded apart (a [pages, 2, page, H, D] cache's k view): the page dim's stride only
    both = tma.kv_args(0x2000, "bf16", paged=True, hnd=False, stride0=2 * 16 * 8 * 128, stride1=8 * 128, **kw)
    assert both.strides == (2048, 128, 16384, 65536)
    d256 = tma.kv_args(0x2000, "bf16", paged=True, hnd=False, stride0=16 * 2 * 256, stride1=2 * 256,
                       **{**kw, "heads": 2, "head_dim": 256})
    assert d256.dims == (64, 8, 8, 2, 10) and d256.box == (64, 8, 4, 2, 1)
    for bad in (dict(stride1=8 * 128 - 64), dict(stride0=15 * 8 * 128)):   # slots, or pages, overlapping
        args = {"stride0": 16 * 8 * 128, "stride1": 8 * 128, **bad}
        assert "overlap" in tma.kv_args(0x2000, "bf16", paged=True, hnd=False, **args, **kw)
    assert isinstance(tma.kv_args(0x2000, "bf16", paged=True, hnd=True, stride0=16 * 8 * 128, stride1=16 * 128,
                                  **kw), str)
    assert isinstance(tma.kv_args(0x2000, "bf16", paged=True, hnd=False, stride0=16 * 8 * 128, stride1=8 * 128,
                                  **{**kw, "box_rows": 8}), str)


@pytest.mark.parametrize("kw,want", [(dict(page_size=16), True), (dict(page_size=32), True),
                                     (dict(page_size=16, layout="HND"), False), (dict(page_size=1), False),
                                     (dict(page_size=48), False), (dict(page_size=128), False),
                                     (dict(page_size=8), False),   # no TMA path: pages of 16k tokens only
                                     (dict(page_size=16, head_dim=64), False), (dict(page_size=16, head_dim=256), True),
                                     (dict(kv="ragged", page_size=None), False),
                                     (dict(page_size=16, dtype=None, dtype_q="bf16", dtype_kv="e4m3"), False),
                                     # by the tile: whole pages smaller than it
                                     (dict(page_size=32, tile="kv160"), True),
                                     (dict(page_size=32, tile="kv176q1"), False),   # 176 is not whole pages of 32
                                     (dict(page_size=64, tile="kv64s3"), False),    # a page is the whole tile
                                     (dict(page_size=64, head_dim=256), False)])    # d256's tile is 64 tokens
def test_kv_interleaved_takes_paged_nhd_tiles_of_whole_pages_of_16k_tokens(kw, want):
    """Where the interleaved layout applies (sm90.KV_INTERLEAVE, on since run 147; enabled=False is the what-if
    plain-kv's host half); the template asserts that the header's Sm90Traits::KV_INTERLEAVED agrees. Where it
    applies, V comes by TMA too: no tile gathers V (sm90.tma_v_gather)."""
    spec = _spec(**kw)
    assert all(sm90.kv_interleaved(spec, t) == want for t in sm90.tiles(spec))
    assert not any(sm90.kv_interleaved(spec, t, enabled=False) for t in sm90.tiles(spec))
    if want:
        assert not any(sm90.tma_v_gather(spec, t) for t in sm90.tiles(spec))


@pytest.mark.nvcc
@pytest.mark.parametrize("what_if,five,four", [(None, 6, 0), ("v-gather", 2, 0), ("plain-kv", 0, 4),
                                               ("plain-kv+v-box", 0, 12)])
def test_the_interleaved_tiles_and_their_what_ifs_build_with_a_box_a_page(tmp_path, what_if, five, four):
    """The default module (interleaved tiles; tile="kv128" is the default's name, so the module holds kv176q1 too) and
    benchmarks/sm90_timeline.py's what-ifs of it (the A/B of run 147) build for sm_90a with the host's half applied.
    Interleaved: K and V by one 5-D box a page (the copy sites in the SASS of the two kernels: 6), or K alone where V
    is gathered (v-gather: 2); plain: a 4-D box a page and 64-column block, K alone (plain-kv, the default before run
    147: 4) or V too (plain-kv+v-box: 12). No local memory (spills)."""
    from benchmarks import sm90_timeline as tl

    spec = _spec(page_size=16, tile="kv128")
    saved = {n: getattr(sm90, n) for n in ("kv_interleaved", "tma_v_gather")}
    render.cache_clear()   # a render is memoized by its spec: the patched host's must neither reuse nor stay
    names = what_if.split("+") if what_if else []
    try:
        for w in names:
            if w in tl._HOST_WHAT_IFS:
                name, wrap = tl._HOST_WHAT_IFS[w]
                setattr(sm90, name, wrap(getattr(sm90, name)))
        src = tl._stamped(render, stamps=False, what_if=what_if)(spec).source
        assert f"KV_INTERLEAVED == {'false' if 'plain-kv' in names else 'true'}" in src
        log, sass = compile_kernel(tmp_path, spec, sass=True, source=src)
    finally:
        for n, f in saved.items():
            setattr(sm90, n, f)
        render.cache_clear()
    assert (len(re.findall(r"\bUTMALDG\.5D\b", sass)), len(re.findall(r"\bUTMALDG\.4D\b", sass))) == (five, four)
    assert_no_spills(log, sass)


@pytest.mark.nvcc
@pytest.mark.parametrize("kw", [dict(head_dim=256), dict(head_dim=256, dtype="fp16", mask="none"),
                                dict(head_dim=256, page_size=32), dict(head_dim=256, page_size=64, layout="HND")])
def test_head_dim_256_kernels_build_without_spills(tmp_path, kw):
    """Head_dim 256 over a 16-bit cache: the producer at 32 registers and the consumers at 232 (Sm90Traits). At 24
    the producer spilled 4-8 bytes with interleaved tiles and V by TMA (pages 16 and 32; HND page 64 before them);
    run 149 (H100) timed 32 / 232 as fast. K and V by 5-D boxes where interleaved, no local memory."""
    spec = _spec(**kw)
    log, sass = compile_kernel(tmp_path, spec, sass=True)
    assert_no_spills(log, sass)
    assert "UTMALDG.5D" in sass if kw.get("layout") != "HND" else "UTMALDG.5D" not in sass


def test_q_args_box_packs_a_group_of_heads_per_token():
    q = torch.empty(300, 32, 128, dtype=torch.bfloat16)
    args = tma.q_args(q, "bf16", 4, 128)
    assert args.dims == (128, 32, 300) and args.box == (64, 4, 32) and args.strides == (256, 32 * 256)
    sliced = q[:, :, :64]  # a strided view: its token stride still nests, its head dim is 64 wide
    assert isinstance(tma.q_args(sliced.contiguous(), "bf16", 4, 128), tma.MapArgs)
    odd = torch.empty(300 * 32 * 128 + 4, dtype=torch.bfloat16)[4:].view(300, 32, 128)  # 8 bytes off
    assert isinstance(tma.q_args(odd, "bf16", 4, 128), str)


@pytest.mark.parametrize("kw,q_box,kv_rows,o_box", [
    (dict(page_size=16), (4, 128), 16, (4, 64)),
    (dict(kv="ragged", page_size=None), (4, 128), 128, (4, 64)),
    (dict(page_size=256), (4, 128), 128, (4, 64)),
    (dict(page_size=1), (4, 128), 0, (4, 64)),       # a page a row: the cp.async gather
    (dict(page_size=48), (4, 128), 0, (4, 64)),      # pages that do not nest with the tile
    (dict(page_size=16, group_size=5), None, 16, None),  # 128 rows are not whole tokens of 5 heads
    (dict(page_size=16, group_size=1), (1, 128), 16, (1, 64)),
    (dict(page_size=16, dtype=None, dtype_q="fp16", dtype_kv="e4m3", dtype_o="fp16"), None, 0, None),  # fp8
])
def test_tma_boxes_say_what_a_kernel_copies(kw, q_box, kv_rows, o_box):
    spec = _spec(**kw)
    tile = sm90.tiles(spec)[0]
    assert sm90.tma_boxes(spec, tile) == (q_box, kv_rows, o_box)


def test_the_sm90_struct_ends_with_aligned_descriptors_and_fa2_has_none():
    lay = attention_layout(None, "sm90")
    at = dict(zip(lay.names, lay.offsets))
    assert all(at[n] % 64 == 0 for n in ("tma_q", "tma_k", "tma_v", "tma_o")) and lay.size % 64 == 0
    assert lay.names[-5:] == ("tma_flags", "tma_q", "tma_k", "tma_v", "tma_o")
    assert "tma_flags" not in attention_layout(None, "fa2").index
    values = [0] * len(lay.names)
    for n in ("tma_q", "tma_k", "tma_v", "tma_o"):
        values[lay.index[n]] = bytes(range(128))
    packed = lay.struct.pack(*values)
    assert packed[at["tma_k"]:at["tma_k"] + 128] == bytes(range(128))
    assert packed[at["tma_o"]:at["tma_o"] + 128] == bytes(range(128))


class _Q:
    shape, dtype = (300, 32, 128), torch.bfloat16

    def __init__(self, ptr: int = 0x10000, strides: tuple = (32 * 128, 128, 1)):
        self.ptr, self.strides = ptr, strides

    def stride(self, i=None):
        return self.strides if i is None else self.strides[i]

    def data_ptr(self):
        return self.ptr


def test_copies_fill_sets_flags_only_for_what_was_encoded(monkeypatch):
    lay = attention_layout(None, "sm90")
    i = lay.index
    copies = tma.Copies(q_box=(4, 128), kv_rows=16, dtype="bf16", paged=True, hnd=False,
                        slots=(i["tma_flags"], i["tma_q"], i["tma_k"], i["tma_v"]))  # a kernel with no O box
    kw = dict(rows=64, page_size=16, heads=8, head_dim=128, stride0=16 * 8 * 128, stride1=8 * 128)
    seen = []
    monkeypatch.setattr(tma, "encode", lambda a: seen.append(a) or bytes([len(seen)]) * 128)
    vals = [0] * len(lay.names)
    assert copies.fill(vals, _Q(), 0x20000, 0x40000, **kw) == "q+kv"
    assert vals[i["tma_flags"]] == tma.FLAG_Q | tma.FLAG_KV and vals[i["tma_k"]] == bytes([2]) * 128
    assert [a.address for a in seen] == [0x10000, 0x20000, 0x40000]
    # an unaligned cache: q still by TMA, k/v by cp.async, no descriptor left from the last run
    assert copies.fill(vals, _Q(), 0x20008, 0x40000, **kw) == "q"
    assert vals[i["tma_flags"]] == tma.FLAG_Q and vals[i["tma_k"]] == bytes(128)
    monkeypatch.setenv("ATTNJIT_TMA", "0")
    assert copies.fill(vals, _Q(), 0x20000, 0x40000, **kw) == "" and vals[i["tma_flags"]] == 0
    # the same tensors again: the memo's answer, no new description or encoding
    monkeypatch.delenv("ATTNJIT_TMA")
    n = len(seen)
    assert copies.fill(vals, _Q(), 0x20000, 0x40000, **kw) == "q+kv" and len(seen) == n
    assert vals[i["tma_k"]] == bytes([2]) * 128 and vals[i["tma_flags"]] == tma.FLAG_Q | tma.FLAG_KV
    # no driver (this machine): nothing is encoded, the kernel copies with cp.async
    monkeypatch.setattr(tma, "encode", lambda a: None)
    fresh = tma.Copies(q_box=(4, 128), kv_rows=16, dtype="bf16", paged=True, hnd=False, slots=copies.slots)
    assert fresh.fill(vals, _Q(), 0x20000, 0x40000, **kw) == "" and vals[i["tma_flags"]] == 0
    assert vals[i["tma_q"]] == bytes(128)


def _page16_copies(monkeypatch, **copies_kw):
    """A page-16 d128 kernel's Copies (no O box), fill's keyword arguments for its cache, the MapArgs encode() was
    given (each encoded as 128 bytes of its 1-based index) and an empty struct: (index, copies, kw, seen, vals)."""
    lay = attention_layout(None, "sm90")
    i = lay.index
    copies = tma.Copies(q_box=(4, 128), kv_rows=16, dtype="bf16", paged=True, hnd=False,
                        slots=(i["tma_flags"], i["tma_q"], i["tma_k"], i["tma_v"]), **copies_kw)
    kw = dict(rows=64, page_size=16, heads=8, head_dim=128, stride0=16 * 8 * 128, stride1=8 * 128)
    seen: list = []
    monkeypatch.setattr(tma, "encode", lambda a: seen.append(a) or bytes([len(seen)]) * 128)
    return i, copies, kw, seen, [0] * len(lay.names)


def test_copies_fill_of_a_v_gathering_kernel_encodes_k_alone(monkeypatch):
    """A kernel that gathers V (sm90.tma_v_gather: pages smaller than its tile) reads K's descriptor only: V's is
    not encoded, a V that TMA could not read leaves K by TMA, and the record says "q+k"; an unaligned K turns K off."""
    i, copies, kw, seen, vals = _page16_copies(monkeypatch, v_gather=True)
    assert copies.fill(vals, _Q(), 0x20000, 0x40008, **kw) == "q+k"   # V unaligned: no matter, it is gathered
    assert [a.address for a in seen] == [0x10000, 0x20000]
    assert vals[i["tma_flags"]] == tma.FLAG_Q | tma.FLAG_KV and vals[i["tma_k"]] == bytes([2]) * 128
    assert vals[i["tma_v"]] == bytes(128)
    assert copies.fill(vals, _Q(), 0x20008, 0x40000, **kw) == "q" and vals[i["tma_flags"]] == tma.FLAG_Q
    assert vals[i["tma_k"]] == bytes(128)


def test_copies_fill_of_an_interleaved_kernel_encodes_k_and_v_by_the_5d_map(monkeypatch):
    """The default paged kernel (interleaved tiles, V by TMA too: sm90.kv_interleaved, not sm90.tma_v_gather) reads
    both descriptors, each a 5-D map of its own cache, a box a page with all of its column blocks; a V that TMA cannot
    read takes K off TMA too (one flag for both), and the record says "q"."""
    i, copies, kw, seen, vals = _page16_copies(monkeypatch, interleaved=True)
    assert copies.fill(vals, _Q(), 0x20000, 0x40000, **kw) == "q+kv"
    k_map, v_map = seen[1], seen[2]
    assert (k_map.address, v_map.address) == (0x20000, 0x40000)
    want = tma.kv_args(0x20000, "bf16", paged=True, hnd=False, box_rows=16, interleaved=True, **kw)
    assert len(k_map.dims) == len(v_map.dims) == 5 and k_map.box == v_map.box == want.box
    assert k_map.dims == v_map.dims == want.dims and k_map.strides == v_map.strides == want.strides
    assert vals[i["tma_flags"]] == tma.FLAG_Q | tma.FLAG_KV
    assert (vals[i["tma_k"]], vals[i["tma_v"]]) == (bytes([2]) * 128, bytes([3]) * 128)
    assert copies.fill(vals, _Q(), 0x20000, 0x40008, **kw) == "q" and vals[i["tma_flags"]] == tma.FLAG_Q
    assert vals[i["tma_k"]] == vals[i["tma_v"]] == bytes(128)


def test_copies_fill_encodes_the_output_where_the_kernel_stores_it_by_tma(monkeypatch):
    lay = attention_layout(None, "sm90")
    i = lay.index
    copies = tma.Copies(q_box=(4, 128), kv_rows=16, dtype="bf16", paged=True, hnd=False,
                        slots=(i["tma_flags"], i["tma_q"], i["tma_k"], i["tma_v"], i["tma_o"]), o_box=(4, 64),
                        o_dtype="fp16")
    kw = dict(rows=64, page_size=16, heads=8, head_dim=128, stride0=16 * 8 * 128, stride1=8 * 128)
    seen = []
    monkeypatch.setattr(tma, "encode", lambda a: seen.append(a) or bytes([len(seen)]) * 128)
    vals = [0] * len(lay.names)
    assert copies.fill(vals, _Q(), 0x20000, 0x40000, out=_Q(0x80000), **kw) == "q+kv+o"
    assert vals[i["tma_flags"]] == tma.FLAG_Q | tma.FLAG_KV | tma.FLAG_O and vals[i["tma_o"]] == bytes([4]) * 128
    o = seen[-1]
    assert o.address == 0x80000 and o.box == (64, 4, 16) and o.dims == (128, 32, 300) and o.dtype == 6  # fp16
    # an output TMA cannot write (an odd token stride): its 16-byte stores, and no descriptor left from the last run
    assert copies.fill(vals, _Q(), 0x20000, 0x40000, out=_Q(0x80000, (32 * 128 + 4, 128, 1)), **kw) == "q+kv"
    assert vals[i["tma_flags"]] == tma.FLAG_Q | tma.FLAG_KV and vals[i["tma_o"]] == bytes(128)
    # a new output address is a new descriptor (the memo is keyed by the output too)
    n = len(seen)
    assert copies.fill(vals, _Q(), 0x20000, 0x40000, out=_Q(0x90000), **kw) == "q+kv+o" and len(seen) == n + 1
    assert seen[-1].address == 0x90000
    monkeypatch.setenv("ATTNJIT_TMA", "0")
    assert copies.fill(vals, _Q(), 0x20000, 0x40000, out=_Q(0x90000), **kw) == "" and vals[i["tma_flags"]] == 0
    assert vals[i["tma_o"]] == bytes(128)


@pytest.mark.nvcc
@pytest.mark.parametrize("kw,copies,five,stores", [(dict(page_size=16), 10, 6, 4),
                                                   (dict(kv="ragged", page_size=None), 16, 0, 4),
                                                   (dict(page_size=1), 2, 0, 2),
                                                   (dict(page_size=16, group_size=5), 6, 6, 0),
                                                   (dict(page_size=16, layout="HND"), 8, 0, 4)])
def test_sm90_kernels_issue_tma_copies_where_their_tiles_allow(tmp_path, kw, copies, five, stores):
    """UTMALDG (cp.async.bulk.tensor loads) in the SASS: Q's two 64-column boxes and each K/V copy site's, per
    kernel of the module (page 16 and ragged: kv128 and kv176q1; page 1, one kernel: Q only; 5 heads a group: K/V
    only). Paged NHD page 16 takes interleaved tiles (sm90.kv_interleaved): K and V by one 5-D box a page (3 sites a
    kernel); HND keeps the plain layout, K by a 4-D box a page and column block, V gathered (sm90/tma.cuh
    tma_v_gather), half a ragged kernel's K/V sites. UTMASTG (its stores): the output's two 64-column boxes per
    kernel, none where a warpgroup's 64 rows are not whole tokens."""
    spec = _spec(**kw)
    log, sass = compile_kernel(tmp_path, spec, sass=True)
    assert len(re.findall(r"\bUTMALDG\b", sass)) == copies
    assert len(re.findall(r"\bUTMALDG\.5D\b", sass)) == five
    assert len(re.findall(r"\bUTMASTG\b", sass)) == stores
    assert "static_assert(sizeof(AttentionParams)" in render(spec).source
