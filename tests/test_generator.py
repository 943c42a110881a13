"""spec -> CUDA source: deterministic bytes, self-contained, #line directives that point at the right lines,
kernel names and parameter structs that match what the generator reports (and what the runtime packs)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from attnjit import generator
from attnjit.cache import Cache, Job
from attnjit.families import tiles_for
from attnjit.generator import INCLUDE_DIR, PARAMS, render
from attnjit.specs import AttentionSpec, load_catalog
from attnjit.toolchain import flags_for, nvcc
from tests.cpu_support import PREFILL_D64, REPO, entry_dir

SPECS = [
    AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4),
    AttentionSpec(op="prefill", head_dim=64, dtype="fp16", kv="ragged", group_size=1),
    AttentionSpec(op="prefill", head_dim=256, page_size=1, dtype="fp16", layout="HND", group_size=8),
    AttentionSpec(op="decode", head_dim=128, page_size=16, dtype="bf16", group_size=4),
    AttentionSpec(op="decode", head_dim=64, page_size=8, dtype="fp16", group_size=32, layout="HND"),
    AttentionSpec(op="merge_state", head_dim=128, dtype="bf16"),
    AttentionSpec(op="append_kv", head_dim=128, page_size=16, dtype="fp16", layout="HND"),
]
IDS = [s.short_name() for s in SPECS]

_KERNEL_RE = re.compile(r'extern "C" __global__ void __launch_bounds__\((\d+)(?:, *(\d+))?\)\s*(\w+)\('
                        r'const __grid_constant__ (\w+) p\)')
_LINE_RE = re.compile(r'^#line (\d+) "([^"]+)"$')
_INCLUDE_RE = re.compile(r'^[ \t]*#include[ \t]+"(attnjit/[^"]+)"[ \t]*$')


def parse_struct(source: str, name: str) -> list[tuple[str, str]]:
    """[(ctype, field)] of ``struct name { ... };`` in source."""
    m = re.search(r"^struct " + name + r" \{\n(.*?)^\};", source, re.S | re.M)
    assert m, f"struct {name} not found"
    fields = re.findall(r"^\s*([\w:]+) (\w+);", m.group(1), re.M)
    assert fields, f"struct {name} has no fields"
    return fields


def origins(source: str) -> list[tuple[str | None, int, str]]:
    """(file, line, text) of every non-directive line, following #line directives as the compiler does
    (file None: the rendered file itself)."""
    out = []
    file, line = None, 1
    for text in source.splitlines():
        m = _LINE_RE.match(text)
        if m:
            line, file = int(m.group(1)), m.group(2)
            continue
        out.append((file, line, text))
        line += 1
    return out


# --- determinism ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_render_is_deterministic(spec):
    a = render.__wrapped__(spec).source  # bypass the lru_cache: two real renders
    b = render.__wrapped__(spec).source
    assert a.encode() == b.encode()
    assert render(spec).source == a
    # an equal spec spelled another way renders the same bytes
    assert render.__wrapped__(AttentionSpec.parse(spec.as_flags())).source == a


def test_render_is_the_same_in_fresh_processes_with_other_hash_seeds():
    here = {s.canonical(): hashlib.sha256(render(s).source.encode()).hexdigest() for s in SPECS}
    script = ("import hashlib, json, sys\n"
              "from attnjit.generator import render\n"
              "from attnjit.specs import AttentionSpec\n"
              "print(json.dumps({c: hashlib.sha256(render(AttentionSpec.parse(c)).source.encode()).hexdigest()"
              " for c in json.loads(sys.argv[1])}))\n")
    for seed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-c", script, json.dumps(list(here))], capture_output=True,
                              text=True, env=env, cwd=REPO, timeout=120, check=True)
        assert json.loads(proc.stdout) == here, f"PYTHONHASHSEED={seed} rendered other bytes"


def test_different_specs_render_different_sources_that_name_their_spec():
    sources = [render(s).source for s in SPECS]
    assert len(set(sources)) == len(SPECS)
    for spec, src in zip(SPECS, sources):
        assert f"Spec: {spec.canonical()}" in src.splitlines()[0]


# --- self-contained source and #line ------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_rendered_source_is_self_contained(spec):
    src = render(spec).source
    assert '#include "attnjit/' not in src
    assert not re.search(r"\{\{ *[\w.]+ *\}\}|\{%-? *(for|endfor|if|endif|from|macro|set) ", src), \
        "unrendered Jinja left in the source"
    # what is left to include comes from the toolkit
    for line in src.splitlines():
        if line.lstrip().startswith("#include"):
            assert re.fullmatch(r"\s*#include <[\w./]+>\s*", line), line
    # every header is inlined once, each marked with a #line directive
    starts = re.findall(r'^#line 1 "(attnjit/[\w.]+)"$', src, re.M)
    assert starts and len(starts) == len(set(starts))
    assert "attnjit/common.cuh" in starts


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_line_directives_point_at_the_header_lines(spec):
    """Every line attributed to attnjit/x.cuh:N is line N of that header (so nvcc errors point at it)."""
    src = render(spec).source
    headers: dict[str, list[str]] = {}
    checked = 0
    for file, line, text in origins(src):
        if file is None or not file.startswith("attnjit/"):
            continue
        lines = headers.setdefault(file, (INCLUDE_DIR / file).read_text().splitlines())
        assert 1 <= line <= len(lines), f"{file}:{line} is past the end of the header"
        want = lines[line - 1]
        if re.fullmatch(r"\s*#pragma once\s*", want):
            assert text == "", (file, line, text)
        elif _INCLUDE_RE.match(want):
            assert text == f"// {_INCLUDE_RE.match(want).group(1)}: already included", (file, line, text)
        else:
            assert text == want, f"{file}:{line}: rendered {text!r}, header has {want!r}"
        checked += 1
    assert checked > 50
    # after the last header the directives return to the rendered file itself
    assert origins(src)[-1][0] == generator.SOURCE_NAME


def test_line_directives_point_at_real_lines_of_the_rendered_file():
    """Template code reports as its own line of kernel.cu (the file the cache keeps), headers as theirs."""
    spec = PREFILL_D64
    src = render(spec).source
    lines = src.splitlines()
    for file, n, text in origins(src):
        if file == generator.SOURCE_NAME:
            assert lines[n - 1] == text, f"kernel.cu:{n} is {lines[n - 1]!r}, not {text!r}"
    assert any(f == generator.SOURCE_NAME and t.startswith("static_assert(Tile_") for f, _, t in origins(src))
    from attnjit import cache

    assert cache.SOURCE == generator.SOURCE_NAME


# --- kernels and parameter structs -----------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_source_defines_exactly_the_kernels_the_generator_reports(spec):
    rendered = render(spec)
    defined = {m.group(3): m for m in _KERNEL_RE.finditer(rendered.source)}
    assert set(defined) == set(rendered.kernels), "kernels in the source differ from Rendered.kernels"
    if spec.op in ("prefill", "decode"):
        # one kernel per tile plan() can pick, each reported with its tile
        tiled = {name for name, info in rendered.kernels.items() if info.tile is not None}
        assert tiled == {t.kernel for t in tiles_for(spec)}
        assert all(rendered.kernels[t.kernel].tile == t for t in tiles_for(spec))
    else:
        assert set(rendered.kernels) == {
            "merge_state": {"attnjit_merge_state", "attnjit_merge_states", "attnjit_merge_partials"},
            "append_kv": {"attnjit_append_kv"}}[spec.op]
    for name, info in rendered.kernels.items():
        m = defined[name]
        assert int(m.group(1)) == info.threads, f"{name}: __launch_bounds__ {m.group(1)} != {info.threads} threads"
        if info.tile is not None:
            assert int(m.group(2)) == info.tile.min_blocks
            assert info.smem == info.tile.smem and info.threads == info.tile.threads


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_param_struct_field_order_matches_the_generator(spec):
    """The struct each kernel takes is laid out field by field as PARAMS says (what the runtime packs)."""
    rendered = render(spec)
    for name, info in rendered.kernels.items():
        struct = next(m.group(4) for m in _KERNEL_RE.finditer(rendered.source) if m.group(3) == name)
        layout = info.layout
        assert parse_struct(rendered.source, struct) == [(f.ctype, f.name) for f in layout.fields], name
        # C's layout: 8-byte fields back to back, a CUtensorMap (sm90's TMA fields) at a multiple of 64, the size a
        # multiple of the largest alignment; the sm90 template asserts both against the compiler's (sizeof, offsetof)
        offset = 0
        for f, at in zip(layout.fields, layout.offsets):
            assert at == offset + (-offset % f.align), (name, f.name)
            offset = at + f.size
        assert layout.size == offset + (-offset % layout.align)
        if any(f.kind == "tmap" for f in layout.fields):
            assert f"static_assert(sizeof(AttentionParams) == {layout.size}," in rendered.source
            assert layout.offsets[layout.index["tma_q"]] % 64 == 0
        else:
            assert layout.size == 8 * len(layout.fields)


def test_param_layout_values_checks_names():
    lay = PARAMS["merge_two"]
    values = lay.values(**{n: i for i, n in enumerate(lay.names)})
    assert values == list(range(len(lay.names)))
    with pytest.raises(TypeError, match=r"missing \['num_heads'\], unknown \['heads'\]"):
        lay.values(**{n: 0 for n in lay.names if n != "num_heads"}, heads=1)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.op in ("prefill", "decode")],
                         ids=[s.short_name() for s in SPECS if s.op in ("prefill", "decode")])
def test_tile_static_asserts_carry_the_generator_numbers(spec):
    src = render(spec).source
    for tile in tiles_for(spec):
        assert f"static_assert(Tile_{tile.name}::SMEM_BYTES == {tile.smem}," in src
        assert f"static_assert(Tile_{tile.name}::NUM_THREADS == {tile.threads}," in src


def test_every_catalog_tile_fits_in_shared_memory():
    specs = {s for name in ("default.toml", "gpu-tests.toml") for s in load_catalog(REPO / "specs" / name)}
    tiles = {t for s in specs for t in tiles_for(s)}
    assert tiles
    for t in tiles:
        assert t.smem <= 227 * 1024, f"{t.name} d{t.head_dim} needs {t.smem} B of shared memory (> 227 KiB)"
        assert t.cta_q % 16 == 0 and t.cta_kv % 16 == 0 and t.threads <= 1024


def test_prefill_tiles_go_narrow_to_wide():
    for spec in SPECS:
        if spec.op == "prefill":
            ts = tiles_for(spec)
            assert [t.cta_q for t in ts] == sorted(t.cta_q for t in ts)
        elif spec.op == "decode":
            t, *deep = tiles_for(spec)
            assert t.cta_q >= spec.group_size  # one decode row's whole group in one tile
            # head_dim 128 adds a deeper-pipeline twin of the same shape for batches that need split-KV
            assert [d.tag for d in deep] == (["deep"] if spec.head_dim_qk == 128 and t.warps_kv == 4 else [])
            assert all((d.cta_q, d.cta_kv, d.stages, d.min_blocks) == (t.cta_q, t.cta_kv, t.stages + 1, 1)
                       for d in deep)


# --- the static_asserts are live: a real compile -----------------------------------------------------------

@pytest.mark.nvcc
def test_tile_smem_formula_agrees_with_the_template_traits(golden, tmp_path):
    """The session cache compiled PREFILL_D64 (two tiles): Tile.smem == AttentionTraits::SMEM_BYTES held.
    A source claiming other numbers fails at the static_assert, and nvcc reports it where #line says."""
    key = golden.key(PREFILL_D64)
    assert (entry_dir(golden.root, key) / "kernel.cu").read_text() == render(PREFILL_D64).source
    tiles = tiles_for(PREFILL_D64)
    assert len(tiles) == 2
    src = render(PREFILL_D64).source
    jobs = []
    for t in tiles:
        needle = f"static_assert(Tile_{t.name}::SMEM_BYTES == {t.smem},"
        assert src.count(needle) == 1
        bad = src.replace(needle, f"static_assert(Tile_{t.name}::SMEM_BYTES == {t.smem + 16},")
        where = next((f, n) for f, n, text in origins(bad) if text.startswith(f"static_assert(Tile_{t.name}::SMEM"))
        jobs.append((Job(source=bad, flags=flags_for("sm_90a"), nvcc=nvcc(), arch="sm_90a", label=f"bad-{t.name}",
                         meta={}), where))
    results = Cache(tmp_path / "cache", layers=()).build([j for j, _ in jobs])
    for (job, (file, line)), r in zip(jobs, results):
        assert r.status == "failed" and r.error is not None, f"{job.label} compiled: the static_assert is not live"
        assert "generator and traits disagree on shared memory" in r.error.log
        assert re.search(rf"{re.escape(file)}\({line}\): error", r.error.log), \
            f"nvcc did not report {file}({line}):\n{r.error.log[-2000:]}"
