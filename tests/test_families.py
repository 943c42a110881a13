"""Kernel families as units: the spec's family field (default, validation, part of the code), each family's headers
reaching only into shared headers or its own folder, the package shipping nested header folders, and fa2 still
compiling for sm_80."""

from __future__ import annotations

import re
import subprocess
import tomllib
from collections import Counter
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

from attnjit import families
from attnjit import variants as V
from attnjit.families import fa2, sm90
from attnjit.generator import INCLUDE_DIR, TEMPLATE_DIR, render
from attnjit.specs import AttentionSpec, SpecError
from attnjit.variants import SOFTCAP
from attnjit.toolchain import flags_for, nvcc

from .cpu_support import assert_no_spills, compile_kernel

ROOT = Path(__file__).resolve().parents[1]
PREFILL = dict(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4)
DECODE = dict(op="decode", head_dim=128, page_size=16, dtype="bf16", group_size=4)


def test_family_defaults_from_the_arch():
    for arch in ("sm_80", "sm_89", "sm_90"):
        assert AttentionSpec(**PREFILL, arch=arch).family == "fa2"
    on_hopper = AttentionSpec(**PREFILL, arch="sm_90a")
    assert on_hopper.family == ("sm90" if sm90.unsupported(on_hopper) is None else "fa2")
    assert AttentionSpec(**DECODE, arch="sm_90a").family == families.default_family(AttentionSpec(**DECODE))
    assert on_hopper.family == "sm90" and AttentionSpec(**DECODE, arch="sm_90a").family == "fa2"  # the values
    # ops without kernels of a family leave it unset
    assert AttentionSpec(op="merge_state", head_dim=128, dtype="bf16").family is None


def test_family_is_validated_with_the_reason():
    with pytest.raises(SpecError) as e:
        AttentionSpec(**PREFILL, family="fa4")
    assert e.value.field == "family" and "fa2" in str(e.value) and "sm90" in str(e.value)
    with pytest.raises(SpecError) as e:
        AttentionSpec(op="merge_state", head_dim=128, dtype="bf16", family="fa2")
    assert e.value.field == "family"
    spec = AttentionSpec(**PREFILL, arch="sm_80")
    reason = sm90.unsupported(spec)
    assert reason  # sm90 needs sm_90a (and more): the spec says so by name
    with pytest.raises(SpecError) as e:
        AttentionSpec(**PREFILL, arch="sm_80", family="sm90")
    assert e.value.field == "family" and reason in str(e.value)


def test_family_is_part_of_the_code_and_the_canonical_form():
    spec = AttentionSpec(**PREFILL, family="fa2")
    assert '"family":"fa2"' in spec.canonical()
    assert AttentionSpec.parse(spec.as_flags()) == spec
    assert "fa2" in spec.short_name()
    assert f"attnjit/{spec.family}/" in render(spec).source  # the family's headers are what it compiles
    assert render(spec).template == fa2.TEMPLATE


def test_replace_re_defaults_a_defaulted_family_and_keeps_an_explicit_one():
    spec = AttentionSpec(**PREFILL, arch="sm_80")
    moved = spec.replace(arch="sm_90a")
    assert moved.family == families.default_family(moved) == "sm90"
    explicit = AttentionSpec(**PREFILL, arch="sm_90a", family="fa2")
    assert explicit.replace(group_size=8).family == "fa2"


def _includes(path: Path) -> list[str]:
    return re.findall(r'^\s*#include\s+"(attnjit/[^"]+)"', path.read_text(), re.M)


def test_family_headers_reach_only_into_shared_headers_or_their_own():
    root = INCLUDE_DIR / "attnjit"
    shared = {p.name for p in root.glob("*.cuh")}
    for name in families.NAMES:
        folder = root / name
        for header in folder.glob("*.cuh"):
            for inc in _includes(header):
                parts = inc.split("/")
                ok = (len(parts) == 2 and parts[1] in shared) or (len(parts) == 3 and parts[1] == name)
                assert ok, f"{header.relative_to(INCLUDE_DIR)} includes {inc}: not shared and not its family's"
    for header in root.glob("*.cuh"):
        for inc in _includes(header):
            assert inc.count("/") == 1, f"shared header {header.name} includes a family header {inc}"


def test_every_template_and_header_ships_in_the_package():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["attnjit"]
    package = ROOT / "attnjit"
    files = [p for p in TEMPLATE_DIR.rglob("*") if p.is_file() and p.suffix in (".jinja", ".cuh")]
    assert any(p.parent.name == "fa2" for p in files)
    for p in files:
        rel = p.relative_to(package).as_posix()
        assert any(fnmatch(rel, pat) and rel.count("/") == pat.count("/") for pat in patterns), \
            f"{rel} is not in pyproject's package-data"


def test_fa2_tile_choice_for_a_batch():
    spec = AttentionSpec(**DECODE)
    narrow, deep = fa2.tiles(spec)
    # few items for a large GPU: the deep tile; a full GPU or no split allowed: the narrow one
    assert fa2.choose_tile(spec, qo_lens=[1] * 4, num_kv_heads=8, allow_split=True, capacity=lambda t: 264) is deep
    assert fa2.choose_tile(spec, qo_lens=[1] * 64, num_kv_heads=8, allow_split=True, capacity=lambda t: 264) is narrow
    assert fa2.choose_tile(spec, qo_lens=[1] * 4, num_kv_heads=8, allow_split=False, capacity=lambda t: 264) is narrow
    prefill = AttentionSpec(**PREFILL)
    small, wide = fa2.tiles(prefill)
    assert fa2.choose_tile(prefill, qo_lens=[1, 2], num_kv_heads=8, allow_split=True, capacity=lambda t: 1) is small
    assert fa2.choose_tile(prefill, qo_lens=[1, 300], num_kv_heads=8, allow_split=True, capacity=lambda t: 1) is wide


@pytest.mark.nvcc
def test_fa2_compiles_for_sm80(tmp_path):
    spec = AttentionSpec(**PREFILL, arch="sm_80")
    src = tmp_path / "k.cu"
    src.write_text(render(spec).source)
    proc = subprocess.run([str(nvcc().path), *flags_for("sm_80"), "-o", str(tmp_path / "k.cubin"), str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "k.cubin").stat().st_size > 0


@pytest.mark.nvcc
@pytest.mark.parametrize("head_dim,page_size,dtype,tile", [(128, 16, "bf16", None), (64, 1, "fp16", None),
                                                       (128, 1, "bf16", None), (256, 16, "bf16", None),
                                                       (256, 0, "bf16", None), (128, 16, "bf16", "kv64s3"),
                                                       (128, 16, "fp16", "kv128q1"), (128, 16, "fp16", "kv128t8")])
def test_sm90_compiles_to_hgmma_without_spills(tmp_path, head_dim, page_size, dtype, tile):
    """The sm90 family's kernels compile for sm_90a with real nvcc; the SASS has HGMMA (wgmma) and no local memory,
    and ptxas reports no spills and no serialized wgmma."""
    kv = {"kv": "ragged"} if page_size == 0 else {"page_size": page_size}
    spec = AttentionSpec(op="prefill", head_dim=head_dim, dtype=dtype, mask="causal", group_size=4, family="sm90",
                         arch="sm_90a", tile=tile, **kv)
    log, sass = compile_kernel(tmp_path, spec, sass=True)
    assert "serialized" not in log, log
    assert_no_spills(log, sass, "the sm90 kernel")
    assert "HGMMA" in sass
    # the driver refuses a launch whose static + dynamic shared memory passes 227 KB (CUDA_ERROR_INVALID_VALUE from
    # the attribute call: RESULTS.md, run 68), which Tile.smem and the traits' static_assert do not see
    static = sum(int(n) for n in re.findall(r"(\d+) bytes smem", log))
    assert static + sm90.tiles(spec)[0].smem <= 227 * 1024, static


@pytest.mark.nvcc
def test_sm90_kv128_runs_a_narrow_last_tile():
    """The kv128 kernel at head_dim 128 holds the narrow last tile (Consumer::narrow_last): its own S alone (8
    HGMMA over the head dim) and a P V of 4 k-slices, beside the 8 + 8 of the first S and the loop's S, and the 8 + 8
    of the loop's P V and the last one alone: 44 HGMMA 64x128x16 in all (32 without it), and no other shape."""
    from benchmarks import sm90_sass as ss

    shapes = Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", ss.sass_of(ss.spec_for())))
    assert shapes == {"64x128x16": 3 * 8 + 2 * 8 + 4}, shapes


@pytest.mark.nvcc
def test_sm90_chained_walk_compiles_where_the_registers_allow(tmp_path):
    """The tile configuration kv128c: kv128 with consecutive items chained (Sm90Traits::CHAIN, sm90/walk.cuh). Its
    default kernel: no spills, consumers at 224 registers and the producer at 56, and HGMMA 64x128x16 over the head
    dim (8 a GEMM) or a narrow tile's 64 keys (4): the first S (8), the loop's S and P V (16), a narrow tile's full
    P V before it and its own S (16), the chained boundary's next S and the done item's last P V, narrow or full
    (8 + 4 + 8), and an unchained end's last P V, narrow or full (4 + 8): 72. Soft-cap's (a logits transform in the
    softmax: chained at 224 it spilled 40 bytes) takes 232 and 40 (WIDE_CONSUMERS), with no spills. RoPE's (a query
    transform: the consumers' barrier before an item's first S) is not chained: instruction for instruction kv128's
    kernel, with its 44 HGMMA."""
    from benchmarks import sm90_sass as ss

    def hgmma(texts):
        return Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", "\n".join(texts)))["64x128x16"]

    def setmaxnreg(texts):   # (the consumers' budget, the producer's), from the two USETMAXREG
        regs = {t.split()[0].split(".")[1]: int(t.split()[-1], 16) for t in texts if t.startswith("USETMAXREG")}
        return regs["TRY_ALLOC"], regs["DEALLOC"]

    built = {}
    for variant, tile in ((None, "kv128c"), (V.SOFTCAP, "kv128c"), (V.ROPE_LLAMA, None), (V.ROPE_LLAMA, "kv128c")):
        spec = ss.spec_for(tile=tile).replace(variant=variant)
        log, sass = compile_kernel(tmp_path, spec, sass=True)
        assert "serialized" not in log, log
        assert_no_spills(log, sass, f"the sm90 kernel of {variant and variant.name} on {tile}")
        built[variant and variant.name, tile] = [text for _, text, _ in ss.instructions(ss.function_of(sass, spec))]
    assert (hgmma(built[None, "kv128c"]), setmaxnreg(built[None, "kv128c"])) == (8 + 16 + 16 + 20 + 12, (224, 56))
    assert (hgmma(built["softcap", "kv128c"]), setmaxnreg(built["softcap", "kv128c"])) == (72, (232, 40))
    assert built["rope_llama", None] == built["rope_llama", "kv128c"]
    assert hgmma(built["rope_llama", None]) == 3 * 8 + 2 * 8 + 4


@pytest.mark.nvcc
@pytest.mark.parametrize("variant", [V.SOFTCAP, V.SLIDING_WINDOW, V.ALIBI, V.CUSTOM_MASK, V.SIGMOID, V.ROPE_LLAMA,
                                     V.SINK], ids=lambda v: v.name)
def test_sm90_variant_kernels_keep_the_wgmma_pipelined_without_spills(tmp_path, variant):
    """Each built-in variant's sm90 kernel (causal, page 16, bf16) keeps its wgmma pipelined (ptxas serializes them
    all when the consumers' registers run short: a narrow last tile with its own S shape did that to five of these)
    and spills nothing."""
    spec = AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4,
                         family="sm90", arch="sm_90a", variant=variant)
    log, sass = compile_kernel(tmp_path, spec, sass=True)
    assert "serialized" not in log, log
    assert_no_spills(log, sass, f"the sm90 kernel of {variant.name}")


@pytest.mark.nvcc
def test_sm90_sass_report_finds_the_main_loop():
    """benchmarks/sm90_sass.py finds the overlapped main loop by its waits and counts it: 16 HGMMA an iteration at
    head_dim 128 (8 for S, 8 for P V), an exponential per score; the serial loop of head_dim 256 is refused by name."""
    from benchmarks import sm90_sass as ss

    rep = ss.analyze(ss.sass_of(ss.spec_for()))
    assert rep["hgmma_in_loop"] == 16
    assert rep["loop"]["opcodes"]["MUFU"] >= 64 and rep["loop"]["stall_cycles"] > rep["loop"]["instructions"] // 2
    assert 0 <= rep["mufu_between_waits"] <= rep["loop"]["opcodes"]["MUFU"] and rep["softmax"]["instructions"] > 0
    with pytest.raises(ValueError, match="wait_group 1"):
        ss.analyze(ss.sass_of(ss.spec_for(head_dim=256)))


@pytest.mark.nvcc
@pytest.mark.parametrize("tile,page_size,dtype,hgmma", [("kv160", 16, "fp16", 18), ("kv176q1", 16, "bf16", 19)])
def test_sm90_wide_kv_tiles_compile_with_a_main_loop_in_registers(tmp_path, tile, page_size, dtype, hgmma):
    """The wide K/V tiles (160 and 176 keys: S and P in 120-132 registers beside O's 64, 232 a consumer thread):
    HGMMA, no serialized wgmma, D/16 + N/16 HGMMA an iteration, no local memory in the consumers' main loop; ptxas
    spills a few bytes of per-item state outside it (kv160 16 B, kv176q1 none at page 16 when this test was written;
    at page 1 the producer, at 40 registers beside its per-token page ids, spills 144-176 B). Refused over fp8."""
    from benchmarks import sm90_sass as ss

    spec = AttentionSpec(op="prefill", head_dim=128, page_size=page_size, dtype=dtype, mask="causal", group_size=4,
                         family="sm90", arch="sm_90a", tile=tile)
    log, sass = compile_kernel(tmp_path, spec, sass=True)
    assert "serialized" not in log, log
    ins = ss.instructions(sass)
    first, last, _, _ = ss.loop_bounds(ins)
    assert [t for _, t, _ in ins[first:last + 1] if ss.opcode(t) in ("LDL", "STL")] == []
    assert sum(ss.opcode(t) == "HGMMA" for _, t, _ in ins[first:last + 1]) == hgmma
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    assert spills and max(spills) <= 96, log
    with pytest.raises(ValueError, match=tile):
        AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype_q="bf16", dtype_o="bf16", dtype_kv="e4m3",
                      mask="causal", group_size=4, family="sm90", arch="sm_90a", tile=tile)


def test_sm90_default_module_takes_its_long_tile_for_long_batches():
    """The default sm90 module holds kv128 and sm90.LONG_TILE (kv176q1); plan() takes the long one when the batch's
    query rows see >= LONG_KEYS keys on average (causal: a request's rows see kv - qo + 1 .. kv). A named tile, a
    variant, fp8, head_dim 256 and page sizes other than 16 keep one kernel."""
    from tests.gpu.cases import HISTORY_KV, HISTORY_QO, LONG_KV, LONG_QO, MIXED_KV, MIXED_QO, PAGED

    base = dict(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4, family="sm90",
                arch="sm_90a")
    spec = AttentionSpec(**base)
    short, long = sm90.tiles(spec)
    assert (short.cta_kv, short.q_stages, long.cta_kv, long.q_stages) == (128, 2, 176, 1)
    pick = lambda s, qo, kv: sm90.choose_tile(s, qo_lens=qo, kv_lens=kv, num_kv_heads=8,  # noqa: E731
                                             allow_split=True, capacity=lambda t: 132)
    assert pick(spec, HISTORY_QO, HISTORY_KV) is long and pick(spec, LONG_QO, LONG_KV) is long
    assert pick(spec, MIXED_QO, MIXED_KV) is short
    assert pick(spec, [8192], [8192]) is long and pick(spec, [2048] * 8, [2048] * 8) is short   # means 4096.5, 1024.5
    assert pick(spec, [4000], [4000]) is short and pick(spec, [4096], [4096]) is long   # 2000.5, 2048.5 keys a row
    noncausal = AttentionSpec(**{**base, "mask": "none"})
    assert pick(noncausal, [2048] * 8, [2048] * 8) is sm90.tiles(noncausal)[1]
    assert pick(noncausal, [512] * 32, [512] * 32) is sm90.tiles(noncausal)[0]
    assert pick(spec, [0, 0], [5000, 5000]) is short and sm90.choose_tile(
        spec, qo_lens=[8192], num_kv_heads=8, allow_split=True, capacity=lambda t: 132) is short  # no kv_lens given
    assert sm90.mean_keys([4, 0], [10, 99], causal=True) == pytest.approx(8.5)
    d64 = AttentionSpec(**{**base, "head_dim": 64})   # from 1024 keys a row at head_dim 64 (sm90.long_keys)
    assert pick(d64, [2048] * 8, [2048] * 8) is sm90.tiles(d64)[1] and pick(d64, [2000] * 8, [2000] * 8) is \
        sm90.tiles(d64)[0]
    d64_case = next(c for c in PAGED if c.name == "paged-d64-long-history")   # the GPU matrix's d64 long-tile case
    assert pick(d64, d64_case.qo_lens, d64_case.kv_lens) is sm90.tiles(d64)[1]
    ragged = AttentionSpec(**{k: v for k, v in base.items() if k != "page_size"}, kv="ragged")
    assert len(sm90.tiles(ragged)) == 2
    for other in (dict(tile="kv128q1"), dict(page_size=1), dict(page_size=48), dict(head_dim=256),
                  dict(variant=SOFTCAP)):
        assert len(sm90.tiles(AttentionSpec(**{**base, **other}))) == 1, other
    fp8 = {k: v for k, v in base.items() if k != "dtype"}
    assert len(sm90.tiles(AttentionSpec(**fp8, dtype_q="bf16", dtype_o="bf16", dtype_kv="e4m3"))) == 1


@pytest.mark.nvcc
def test_sm90_three_consumers_compile_with_a_main_loop_in_registers(tmp_path):
    """The three-consumer tile (q192kv64: 192-row items, 64-token K/V tiles, 160 registers a consumer thread; here
    at head_dim 128, where its registers are tightest):
    HGMMA, no serialized wgmma, 12 HGMMA an iteration (8 for S at n64, 4 for P V), and no local memory in the main
    loop. ptxas spills a few bytes of per-item state outside it at 160 registers (20 B when this test was written);
    they are loaded once an item, not once a tile. Its fp8 and head_dim 256 forms are refused by name."""
    from benchmarks import sm90_sass as ss

    spec = AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4,
                         family="sm90", arch="sm_90a", tile="q192kv64")
    log, sass = compile_kernel(tmp_path, spec, sass=True)
    assert "serialized" not in log, log
    ins = ss.instructions(sass)
    first, last, _, _ = ss.loop_bounds(ins)
    assert [t for _, t, _ in ins[first:last + 1] if ss.opcode(t) in ("LDL", "STL")] == []
    assert sum(ss.opcode(t) == "HGMMA" for _, t, _ in ins[first:last + 1]) == 12
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    assert spills and max(spills) <= 96, log  # a growing spill is a regression to look at
    for bad in (dict(head_dim=256), dict(dtype_q="bf16", dtype_o="bf16", dtype_kv="e4m3")):
        fields = dict(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4,
                      family="sm90", arch="sm_90a")
        if "dtype_kv" in bad:
            fields.pop("dtype")
        with pytest.raises(ValueError, match="q192kv64"):
            AttentionSpec(**{**fields, **bad}, tile="q192kv64")


def test_sm90_timeline_tool_still_finds_the_consumer_loop():
    """benchmarks/sm90_timeline.py inserts its stamps into the rendered sm90 source by matching the consumer's main
    loop text: a change to that loop must update the tool (it stops with a message), not leave it measuring nothing."""
    from benchmarks import sm90_timeline as tl

    spec = AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4,
                         family="sm90", arch="sm_90a")
    src = tl._stamped(render)(spec).source
    assert src.count("tl(") == 7 + 1 and "++tl_rec;" in src and "clock64()" in src
    # the per-item stamps (I0..I3, the epilogue's E1 E2 and the walk's W) and their region after the loop records,
    # over a 16-bit and an fp8 cache
    for kv in ("bf16", "e4m3"):
        src = tl._stamped(render)(tl._spec(True, kv)).source
        assert src.count("tli(") == 7 + 1 and "++c.tl_item;" in src and "ITEM_BASE" not in src
        # E1 and E2 in the epilogue (sm90/attention.cuh), I3 after it in the walk (sm90/walk.cuh, included earlier)
        assert src.index("tli(5)") < src.index("tli(6)") and src.count("c.write_item(c.it, c.qstage);\n    c.tli(3);") == 1
        assert f"tmp_o) + {tl.ITEM_BASE} +" in src
    assert tl._stamped(render)(spec.replace(family="fa2")).source == render(spec.replace(family="fa2")).source


def test_sm90_timeline_what_if_patches_still_apply():
    """Each what-if of benchmarks/sm90_timeline.py (an upper bound measured on the GPU) changes exactly its
    statement of the rendered kernel, with stamps or without; a kernel change that loses the statement stops it."""
    from benchmarks import sm90_timeline as tl

    spec = tl._spec(True, "bf16")
    plain = render(spec).source
    for name, pairs in tl.WHAT_IFS.items():
        pairs = pairs if isinstance(pairs[0], tuple) else (pairs,)   # one statement, or several
        patched = tl._stamped(render, stamps=False, what_if=name)(spec).source
        expect = plain
        for old, new in pairs:
            expect = expect.replace(old, new)
        assert patched != plain and patched == expect and all(patched.count(new) == 1 for _, new in pairs)
        assert "clock64()" not in patched
        stamped = tl._stamped(render, what_if=name)(spec).source
        assert all(stamped.count(new) == 1 for _, new in pairs)
    assert tl._stamped(render, stamps=False)(spec).source == plain
    with pytest.raises(SystemExit, match="WHAT_IFS"):
        tl._patched("no such kernel", "no-store")


def test_sm90_timeline_checks_its_output_against_sdpa_with_gqa_heads():
    """--time's max_diff (the first GPU call of a what-if is also its correctness check): query head h reads kv head
    h // 4, each request on its own rows, causal or not; an output off by one in one row is seen."""
    from benchmarks import sm90_timeline as tl

    torch.manual_seed(0)
    b, L = 2, 24
    q = torch.randn(b * L, 32, 128)
    k, v = torch.randn(b * L, 8, 128), torch.randn(b * L, 8, 128)
    for causal in (True, False):
        o = torch.empty_like(q)
        for r in range(b):
            t = slice(r * L, (r + 1) * L)
            s = torch.einsum("qhd,khd->hqk", q[t].double(), k[t].repeat_interleave(4, dim=1).double()) / 128 ** 0.5
            if causal:
                s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
            o[t] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[t].repeat_interleave(4, dim=1).double()).float()
        assert tl._max_diff(o, q, k, v, b, L, causal) < 1e-4
        o[L + 5, 17] += 1.0
        assert tl._max_diff(o, q, k, v, b, L, causal) > 0.5


@pytest.mark.parametrize("ragged", [False, True])
def test_sm90_timeline_specs_are_what_its_wrappers_plan(ragged, monkeypatch):
    """The timeline's spec (paged, or ``--layout ragged``) is the one its wrapper's plan runs: the script asserts it
    on the GPU, after a build here that must have compiled that very spec."""
    import torch

    import attnjit
    from benchmarks import sm90_timeline as tl

    monkeypatch.setenv("ATTNJIT_NUM_SMS", "132")
    monkeypatch.setenv("ATTNJIT_ARCH", "sm_90a")
    ws = torch.zeros(1 << 20, dtype=torch.uint8)
    qo = torch.arange(0, 8 * 2048 + 1, 2048, dtype=torch.int32)
    if ragged:
        w = attnjit.BatchPrefillWithRaggedKVCacheWrapper(ws, backend="fa3")
        w.plan(qo, qo, 32, 8, 128, causal=True, q_data_type=torch.bfloat16, disable_split_kv=True)
    else:
        pages = torch.arange(0, 8 * 128 + 1, 128, dtype=torch.int32)
        w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, backend="fa3")
        w.plan(qo, pages, torch.arange(8 * 128, dtype=torch.int32), torch.full((8,), 16, dtype=torch.int32),
               32, 8, 128, 16, causal=True, q_data_type=torch.bfloat16, disable_split_kv=True)
    assert w._plan.spec == tl._spec(True, "bf16", ragged=ragged)


def _built_with_and_without_page_offsets(tmp_path, **kw) -> dict:
    """An sm90 prefill kernel (causal, group 4 unless ``kw`` says) compiled as rendered (key None) and as the
    page-offsets what-if of benchmarks/sm90_timeline.py: (ptxas log, SASS, its instruction texts) of each."""
    from benchmarks import sm90_sass as ss
    from benchmarks import sm90_timeline as tl

    base = dict(op="prefill", head_dim=128, mask="causal", group_size=4, family="sm90", arch="sm_90a")
    spec = AttentionSpec(**{**base, **kw})
    out = {}
    for what_if in (None, "page-offsets"):
        src = tl._stamped(render, stamps=False, what_if=what_if)(spec).source
        assert f"kGatherPageBase = {'false' if what_if else 'true'};" in src
        log, sass = compile_kernel(tmp_path, spec, sass=True, source=src)
        out[what_if] = (log, sass, [text for _, text, _ in ss.instructions(sass)])
    return out


@pytest.mark.nvcc
@pytest.mark.parametrize("kw", [dict(page_size=1, dtype="bf16"), dict(page_size=4, dtype="fp16", layout="HND"),
                                dict(page_size=8, dtype="bf16", mask="none")])
def test_sm90_gathers_small_pages_from_per_thread_bases(tmp_path, kw):
    """The producer's cp.async gather of pages smaller than a copy pass (attnjit/kv_load.cuh gather_page_base): a
    row's address is the thread's base plus its page id times the page stride in bytes. The default build has no
    local memory (the old code spilled 8 bytes at page 1 bf16, in the producer's item setup) and is shorter than
    the same kernel computing each row's offset in elements (benchmarks/sm90_timeline.py's what-if page-offsets,
    the code before run 150). Head_dim 256 and q192kv64 keep that code: their producers spilled more with the
    bases (the second test)."""
    built = _built_with_and_without_page_offsets(tmp_path, **kw)
    assert_no_spills(*built[None][:2], "the default small-page kernel")
    count = {w: len(ins) for w, (_, _, ins) in built.items()}
    assert count[None] < count["page-offsets"] - 64, count


@pytest.mark.nvcc
@pytest.mark.parametrize("kw", [dict(head_dim=256, page_size=1, layout="HND", dtype="fp16"),
                                dict(head_dim=64, page_size=1, dtype="bf16", tile="q192kv64")])
def test_sm90_small_pages_keep_the_offsets_where_the_producer_is_tight(tmp_path, kw):
    """Head_dim 256 and the three-consumer q192kv64 compute each row's offset in elements (Sm90Traits
    GATHER_PAGE_BASE false): with the per-thread bases their producers spilled 4-20 bytes more (d256 page 1 HND 24
    against 4). Their kernels are the page-offsets what-if's, instruction for instruction."""
    built = _built_with_and_without_page_offsets(tmp_path, **kw)
    assert built[None][2] and built[None][2] == built["page-offsets"][2]
