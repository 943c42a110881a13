"""The `attnjit` command, run as a user runs it (``python -m attnjit.cli`` in a subprocess): warm, cache
list/verify/clear/prune, info, render, catalog from-log. Failures exit non-zero with one ``attnjit: error:`` line."""

from __future__ import annotations

import json
import os
import re
from dataclasses import fields

import pytest

from attnjit.cache import Cache
from attnjit.dispatch import DispatchRecord
from attnjit.generator import render
from attnjit.specs import AttentionSpec, load_catalog
from attnjit.toolchain import find_nvcc
from tests.cpu_support import (APPEND_FP16, DATA, MERGE_BF16, MERGE_FP16, PREFILL_D64, REPO, entry_dir, parse_summary,
                               run_cli)

SAMPLE_LOG = DATA / "sample_run.jsonl"
# what the sample run dispatched: Llama-3-8B-shaped prefill and decode (bf16, page 16, 32 q / 8 kv heads)
SAMPLE_SPECS = [  # what the sample record ran: fa2 (a narrow prefill batch, and decode)
    AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4, family="fa2"),
    AttentionSpec(op="decode", head_dim=128, page_size=16, dtype="bf16", group_size=4),
]


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("attnjit: error:")]


# --- warm -----------------------------------------------------------------------------------------------------

@pytest.mark.nvcc
def test_warm_of_cached_specs_prints_the_summary(golden, tmp_path):
    root = golden.copy(tmp_path / "cache")
    catalog = tmp_path / "golden.toml"
    catalog.write_text("\n".join(["[[spec]]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in s.to_dict().items())
                                  for s in golden.specs]))
    # the catalog plus one repeated --spec: 4 distinct specs
    proc = run_cli("warm", catalog, "--spec", MERGE_FP16.as_flags(), "--cache-dir", root)
    assert proc.returncode == 0, proc.stderr
    assert parse_summary(proc.stdout) == (4, 0, 4, 0)
    assert proc.stdout.count("\n") == 1, "warm prints one summary line on stdout (progress goes to stderr)"
    assert f"warming 4 spec(s) into {root}" in proc.stderr
    assert error_lines(proc.stderr) == []


def test_arch_option_fills_in_specs_that_name_none():
    proc = run_cli("render", "--spec", "op=merge_state,head_dim=64,dtype=fp16", "--arch", "sm_80")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("// ===== " + AttentionSpec(op="merge_state", head_dim=64, dtype="fp16",
                                                              arch="sm_80").canonical() + "\n")


def test_warm_reports_a_failed_compile_and_exits_1(tmp_path):
    failing = tmp_path / "failing-nvcc"
    failing.write_text('#!/bin/sh\ncase " $* " in *" --version "*) echo "Cuda compilation tools, release 13.0, '
                       'V13.0.88"; exit 0;; esac\necho "kernel.cu(3): error: simulated failure" >&2\nexit 2\n')
    failing.chmod(0o755)
    env = dict(os.environ, ATTNJIT_NVCC=str(failing))
    root = tmp_path / "cache"
    proc = run_cli("warm", "--spec", MERGE_FP16.as_flags(), "--cache-dir", root, env=env)
    assert proc.returncode == 1
    assert parse_summary(proc.stdout) == (1, 0, 0, 1)
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"attnjit: error: {MERGE_FP16.short_name()}: kernel.cu(3): error: simulated failure "
                           f"(log: {root / 'failed'}/")
    log = line[line.index("(log: ") + 6:-1]
    assert log.endswith("/build.log") and "simulated failure" in open(log).read()
    assert list(Cache(root, layers=()).iter_entries()) == []


@pytest.mark.parametrize("text,where", [
    ('[[spec]]\nop = "merge_state"\nhead_dim = 64\ndtype = "fp16"\n\n[[spec]]\nop = "decode"\nhead_dim = 128\n'
     'dtype = "bf16"\npage_size = [16, 2000]\n', r"\[\[spec\]\] table #2: field 'page_size': 2000 is not supported"),
    ('[[spec]]\nop = "decode"\nhead_dim = 128\ncolor = "red"\n',
     r"\[\[spec\]\] table #1: field 'color': unknown field"),
    ('[[spec]]\nop = "decode"\nhead_dim = [128\n', r"not valid TOML"),
])
def test_warm_of_a_bad_catalog_is_one_error_line(tmp_path, text, where):
    catalog = tmp_path / "bad.toml"
    catalog.write_text(text)
    proc = run_cli("warm", catalog, "--cache-dir", tmp_path / "cache")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == error_lines(proc.stderr), "more than the one error line on stderr"
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"attnjit: error: {catalog}: ") and re.search(where, line), line
    assert not (tmp_path / "cache").exists()


def test_warm_of_a_bad_spec_names_the_field():
    proc = run_cli("warm", "--spec", "op=decode,head_dim=96,page_size=16,dtype=fp16")
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert line.startswith("attnjit: error: --spec: field 'head_dim_qk': ") and "96" in line and "64, 128, 256" in line


def test_warm_without_specs_says_what_to_give():
    proc = run_cli("warm")
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert "no specs: give a catalog file or --spec key=value" in line


def test_warm_without_nvcc_is_one_error_line(tmp_path):
    env = dict(os.environ, ATTNJIT_NVCC=str(tmp_path / "missing-nvcc"))
    proc = run_cli("warm", "--spec", MERGE_FP16.as_flags(), "--cache-dir", tmp_path / "cache", env=env)
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert line.startswith("attnjit: error: nvcc not found; looked at ATTNJIT_NVCC=") and "Traceback" not in proc.stderr


# --- cache ----------------------------------------------------------------------------------------------------

@pytest.mark.nvcc
def test_cache_list_verify_prune_clear(golden, tmp_path):
    root = golden.copy(tmp_path / "cache")
    proc = run_cli("cache", "list", "--cache-dir", root)
    assert proc.returncode == 0
    lines = proc.stdout.strip().splitlines()
    sizes = {s: sum(p.stat().st_size for p in entry_dir(root, golden.key(s)).iterdir()) for s in golden.specs}
    assert lines[-1] == f"4 entries, {sum(sizes.values()) / 1024:.1f} KiB"
    assert [ln.split()[1] for ln in lines[:-1]] == sorted(s.short_name() for s in golden.specs), "not sorted by label"
    tool = Cache(root, layers=()).lookup(golden.key(MERGE_FP16)).toolchain
    for spec in golden.specs:
        row = next(ln for ln in lines if ln.startswith(golden.key(spec)[:16]))
        assert spec.short_name() in row and row.endswith("root") and f"{sizes[spec] / 1024:.1f} KiB" in row
        assert f"  {tool} " in row, "the row does not name the toolchain that built it"

    proc = run_cli("cache", "verify", "--cache-dir", root)
    assert proc.returncode == 0 and proc.stdout.strip() == "4 entries checked, 0 bad"

    (entry_dir(root, golden.key(MERGE_BF16)) / "manifest.json").unlink()
    proc = run_cli("cache", "list", "--cache-dir", root)
    assert re.search(rf"^{golden.key(MERGE_BF16)[:16]}  BAD \(manifest.json missing\)  root$", proc.stdout, re.M)
    assert proc.stdout.strip().splitlines()[-1].endswith(", 1 bad")
    proc = run_cli("cache", "verify", "--cache-dir", root)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines() == [f"BAD {entry_dir(root, golden.key(MERGE_BF16))}: manifest.json missing",
                                                "4 entries checked, 1 bad"]

    # prune: the bad entry goes first, then the least recently used
    sizes = {s: sum(p.stat().st_size for p in entry_dir(root, golden.key(s)).iterdir()) for s in golden.specs}
    keep = sizes[APPEND_FP16] + sizes[PREFILL_D64] + sizes[MERGE_FP16]
    proc = run_cli("cache", "prune", "--max-bytes", keep, "--cache-dir", root)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"removed 1 entries; {keep} bytes ({keep / 1024:.1f} KiB) remain in {root}"
    proc = run_cli("cache", "prune", "--cache-dir", root)
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "attnjit: error: cache prune needs --max-bytes SIZE (e.g. 500M), --built-by TOOLCHAIN (see attnjit cache "
        "list) or --keep CATALOG"]
    for bad in ("-1", "5X", "lots"):
        proc = run_cli("cache", "prune", "--max-bytes", bad, "--cache-dir", root)
        assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
        assert f"argument --max-bytes: {bad!r} is not a size" in error_lines(proc.stderr)[0]
    proc = run_cli("cache", "prune", "--max-bytes", "1K", "--dry-run", "--cache-dir", root)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("would remove 3 entries; 0 bytes")
    assert len(list(Cache(root, layers=()).iter_entries())) == 3, "a dry run removed something"
    proc = run_cli("cache", "prune", "--max-bytes", "500M", "--cache-dir", root)
    assert proc.returncode == 0 and proc.stdout.startswith("removed 0 entries")

    proc = run_cli("cache", "clear", "--dry-run", "--cache-dir", root)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == f"would remove 3 entries from {root}"
    assert sum(ln.startswith("would remove /") for ln in proc.stdout.splitlines()) == 3
    assert len(list(Cache(root, layers=()).iter_entries())) == 3, "a dry run removed something"
    proc = run_cli("cache", "clear", "--cache-dir", root)
    assert proc.returncode == 0 and proc.stdout.strip() == f"removed 3 entries from {root}"
    proc = run_cli("cache", "list", "--cache-dir", root)
    assert proc.stdout.strip() == "0 entries, 0 B"


@pytest.mark.nvcc
def test_cache_commands_use_the_environment_root_and_layers(golden, tmp_path):
    layer = golden.copy(tmp_path / "layer")
    env = dict(os.environ, ATTNJIT_CACHE_DIR=str(tmp_path / "root"), ATTNJIT_CACHE_PATH=str(layer))
    proc = run_cli("cache", "list", env=env)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("4 entries, ")
    assert all(ln.endswith(f"layer {layer}") for ln in proc.stdout.strip().splitlines()[:-1])
    proc = run_cli("cache", "clear", env=env)  # never touches a layer
    assert proc.stdout.strip() == f"removed 0 entries from {tmp_path / 'root'}"
    assert len(list(Cache(layer, layers=()).iter_entries())) == 4


def test_an_unsafe_root_is_one_error_line(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    proc = run_cli("warm", "--spec", MERGE_FP16.as_flags(), "--cache-dir", root)
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert f"cache root {root} is writable by other users (mode 0777)" in line


# --- info -----------------------------------------------------------------------------------------------------

@pytest.mark.nvcc
def test_info_prints_nvcc_arch_root_and_layers(tmp_path):
    root, layer = tmp_path / "root", tmp_path / "layer"
    proc = run_cli("info", "--cache-dir", root)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(rf"^nvcc: {re.escape(str(find_nvcc()))} \(release \d+\.\d+\)$", out, re.M), out
    assert re.search(r"^gpus: ", out, re.M)
    if "gpus: none\n" in out:
        assert "warm arch: sm_90a (from the default (no GPU here))\n" in out
    assert f"cache root: {root} (writable)\n" in out
    assert "cache layers: (none; set ATTNJIT_CACHE_PATH)\n" in out
    assert "strict mode (ATTNJIT_JIT=0): off\n" in out

    layer.mkdir()
    env = dict(os.environ, ATTNJIT_CACHE_DIR=str(root), ATTNJIT_CACHE_PATH=str(layer), ATTNJIT_ARCH="sm_80",
               ATTNJIT_JIT="0")
    out = run_cli("info", env=env).stdout
    assert f"cache layers: {layer}\n" in out and f"  {layer}: 0 entries, 0.0 KiB\n" in out
    assert f"  {root}: 0 entries, 0.0 KiB (absent)\n" in out
    assert ("warm arch: sm_80 (from ATTNJIT_ARCH)\n" in out or "gpus: none\n" not in out)
    assert "strict mode (ATTNJIT_JIT=0): on\n" in out


def test_info_without_nvcc_still_works(tmp_path):
    env = dict(os.environ, ATTNJIT_NVCC=str(tmp_path / "missing"))
    proc = run_cli("info", env=env)
    assert proc.returncode == 0
    assert re.search(r"^nvcc: not found \(nvcc not found; looked at ATTNJIT_NVCC=", proc.stdout, re.M)


# --- render ---------------------------------------------------------------------------------------------------

def test_render_prints_each_catalog_spec_source():
    catalog = REPO / "specs" / "ci.toml"
    proc = run_cli("render", catalog)
    assert proc.returncode == 0, proc.stderr
    parts = re.split(r"^// ===== (.*)\n", proc.stdout, flags=re.M)
    assert parts[0] == ""
    specs = load_catalog(catalog)
    assert parts[1::2] == [s.canonical() for s in specs]
    for spec, source in zip(specs, parts[2::2]):
        assert source == render(spec).source


def test_render_of_one_spec():
    proc = run_cli("render", "--spec", "op=append_kv,head_dim=64,page_size=16,dtype=fp16")
    assert proc.returncode == 0
    assert proc.stdout == f"// ===== {APPEND_FP16.canonical()}\n" + render(APPEND_FP16).source


@pytest.mark.parametrize("spec,arch", [
    ('{"op":"merge_state","head_dim":64,"dtype":"fp16"}', "sm_80"),                 # JSON without arch: --arch's
    ('{"op":"merge_state","head_dim":64,"dtype":"fp16","arch":"sm_90a"}', "sm_90a"),  # JSON's own arch
    ("op=merge_state,head_dim=64,dtype=fp16", "sm_80"),
])
def test_a_spec_that_names_no_arch_takes_the_arch_option_in_either_form(spec, arch):
    proc = run_cli("render", "--spec", spec, "--arch", "sm_80")
    assert proc.returncode == 0 and proc.stdout.splitlines()[0].endswith(f'"arch":"{arch}"}}')


@pytest.mark.parametrize("spec", ["op=merge_state,head_dim=64,head_dim=128,dtype=fp16",
                                  '{"op":"merge_state","head_dim":64,"head_dim":128,"dtype":"fp16"}'])
def test_a_spec_key_given_twice_is_an_error(spec):
    proc = run_cli("render", "--spec", spec)
    assert proc.returncode != 0 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("head_dim given more than once")


# --- catalog from-log -------------------------------------------------------------------------------------------

def test_sample_log_has_the_dispatch_record_format():
    """tests/data/sample_run.jsonl holds records as DispatchRecord.to_json wrote them before records named the
    toolchain (``built_by``, the last field): old logs still read, and a record round-trips."""
    lines = SAMPLE_LOG.read_text().splitlines()
    assert len(lines) == 3
    names = [f.name for f in fields(DispatchRecord)]
    assert names[-1] == "built_by"
    for line in lines:
        d = json.loads(line)
        assert list(d) == names[:-1]
        record = DispatchRecord(**{**d, "grid": tuple(d["grid"]), "block": tuple(d["block"])})
        assert record.built_by is None and record.to_json() == line[:-1] + ',"built_by":null}'
        record = DispatchRecord(**{**d, "grid": tuple(d["grid"]), "block": tuple(d["block"]),
                                   "built_by": "nvcc 13.0 V13.0.88"})
        assert json.loads(record.to_json())["built_by"] == "nvcc 13.0 V13.0.88"
        spec = AttentionSpec.from_dict(json.loads(d["spec"]))
        assert spec.canonical() == d["spec"]


def test_catalog_from_log_writes_the_dispatched_specs(tmp_path):
    out = tmp_path / "from-log.toml"
    proc = run_cli("catalog", "from-log", SAMPLE_LOG, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote 2 specs to {out}"
    assert load_catalog(out) == SAMPLE_SPECS  # the repeated decode record appears once
    text = out.read_text()
    assert text.startswith("# Specs dispatched in sample_run.jsonl (2)")
    # without -o the catalog goes to stdout
    proc = run_cli("catalog", "from-log", SAMPLE_LOG)
    assert proc.returncode == 0 and proc.stdout == text


@pytest.mark.nvcc
def test_warm_of_a_catalog_from_a_log_builds_its_specs(tmp_path):
    out = tmp_path / "from-log.toml"
    assert run_cli("catalog", "from-log", SAMPLE_LOG, "-o", out).returncode == 0
    root = tmp_path / "cache"
    proc = run_cli("warm", out, "--cache-dir", root)
    assert proc.returncode == 0, proc.stderr
    assert parse_summary(proc.stdout) == (2, 2, 0, 0)
    for spec in SAMPLE_SPECS:
        assert re.search(rf"^  built {re.escape(spec.short_name())} in \d+\.\d s$", proc.stderr, re.M)
    cache = Cache(root, layers=())
    assert cache.verify() == []
    built = {AttentionSpec.from_dict(e.manifest["meta"]["spec"]) for _, _, e, _ in cache.iter_entries() if e}
    assert built == set(SAMPLE_SPECS)
    proc = run_cli("warm", out, "--cache-dir", root)
    assert parse_summary(proc.stdout) == (2, 0, 2, 0)


def test_catalog_from_log_imports_no_variant_module(tmp_path):
    """A dispatch log is data: a variant it names stays module:attribute text in the catalog, and no module runs.
    (warm of that catalog imports it, as it must to render the kernel.)"""
    marker = tmp_path / "imported"
    (tmp_path / "planted.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    first = json.loads(SAMPLE_LOG.read_text().splitlines()[0])
    spec = json.loads(first["spec"])
    logged = [{**first, "spec": json.dumps({**spec, "variant": ref})} for ref in ("planted:VARIANT", "planted:VARIANT",
                                                                                  "planted:A+attnjit.variants:SOFTCAP")]
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in logged))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    proc = run_cli("catalog", "from-log", log, "-o", tmp_path / "c.toml", env=env)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists(), "catalog from-log imported the logged variant's module"
    text = (tmp_path / "c.toml").read_text()
    assert text.count("[[spec]]") == 2
    assert 'variant = "planted:VARIANT"' in text and 'variant = "planted:A+attnjit.variants:SOFTCAP"' in text
    assert text.index("variant =") < text.index("family =")   # declaration order, as to_dict writes it
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**first, "spec": json.dumps({**spec, "variant": "planted; import os"})}) + "\n")
    proc = run_cli("catalog", "from-log", bad, env=env)
    assert proc.returncode == 1 and f"{bad}:1: not a dispatch record" in proc.stderr and "module:attribute" in proc.stderr
    merge = {"op": "merge_state", "head_dim_vo": 128, "dtype_o": "fp16", "arch": "sm_90a",
             "variant": "attnjit.variants:SOFTCAP"}   # an op that takes no variant, refused as load_catalog would
    bad.write_text(json.dumps({**first, "spec": json.dumps(merge)}) + "\n" + "[" * 100000 + "\n")
    proc = run_cli("catalog", "from-log", bad, env=env)
    assert proc.returncode == 1 and "does not use variant" in proc.stderr and "Traceback" not in proc.stderr
    bad.write_text("[" * 100000 + "\n")
    proc = run_cli("catalog", "from-log", bad, env=env)
    assert proc.returncode == 1 and "nested too deeply" in proc.stderr and "Traceback" not in proc.stderr


def test_catalog_from_a_bad_log_names_the_line(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text(SAMPLE_LOG.read_text().splitlines()[0] + "\n\n" + '{"op": "decode"}\n')
    proc = run_cli("catalog", "from-log", log)
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"attnjit: error: {log}:3: not a dispatch record")
    proc = run_cli("catalog", "from-log", tmp_path / "absent.jsonl")
    assert proc.returncode == 1 and "cannot read" in error_lines(proc.stderr)[0]
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    proc = run_cli("catalog", "from-log", binary)
    assert proc.returncode == 1
    assert error_lines(proc.stderr) == [f"attnjit: error: {binary}: not UTF-8 text (invalid start byte at byte 0)"]


def test_catalog_from_log_writes_its_output_whole_and_never_into_a_fifo(tmp_path):
    out = tmp_path / "from-log.toml"
    out.write_text("# the old catalog\n")
    assert run_cli("catalog", "from-log", SAMPLE_LOG, "-o", out).returncode == 0
    assert load_catalog(out) == SAMPLE_SPECS and [p.name for p in tmp_path.iterdir()] == ["from-log.toml"]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = run_cli("catalog", "from-log", SAMPLE_LOG, "-o", fifo)   # would block forever on open before
    assert proc.returncode == 1
    assert error_lines(proc.stderr) == [f"attnjit: error: cannot write {fifo}: {fifo} exists and is not a regular "
                                        "file; a catalog is written only as one"]
    proc = run_cli("catalog", "from-log", SAMPLE_LOG, "-o", tmp_path / "no-such-dir" / "c.toml")
    assert proc.returncode == 1 and error_lines(proc.stderr) == [
        f"attnjit: error: cannot write {tmp_path / 'no-such-dir' / 'c.toml'}: No such file or directory"]


def test_ncu_source_summary_splits_samples_by_region_and_execution_count(tmp_path):
    """benchmarks/ncu_source.py (the profile stage's summary of `ncu --page source --csv`): on a small synthetic
    listing, the loop is found from its backward branch, samples are split into prologue / loop / epilogue and by
    execution count, and stall reasons are summed."""
    import subprocess
    import sys

    rows = [
        ("0x1000", "LDG.E R2, [R4.64]", 10, 4, 10, 0),          # prologue: run once per warp
        ("0x1010", "HMMA.16816.F32 R8, R10, R12, R8", 60, 40, 0, 50),
        ("0x1020", "@P0 BRA 0x1010", 20, 5, 0, 20),              # the loop's backward branch
        ("0x1030", "STG.E [R4.64], R8", 10, 1, 10, 0),
    ]
    exec_counts = {"0x1000": 100, "0x1010": 800, "0x1020": 800, "0x1030": 100}
    lines = ['"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
             '"Instructions Executed","stall_long_sb","stall_wait"']
    for addr, src, samples, not_issued, long_sb, wait in rows:
        lines.append(f'"{addr}","{src}","{samples}","{not_issued}","{exec_counts[addr]}","{long_sb}","{wait}"')
    csv_path = tmp_path / "src.csv"
    csv_path.write_text("==PROF== preamble line\n" + "\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ncu_source.py"), str(csv_path), "3"],
                         capture_output=True, text=True, check=True).stdout
    assert "loop 0x1010..0x1020; samples 100: prologue 10.0%" in out
    assert "loop 80.0%" in out and "epilogue 10.0%" in out
    assert "800x: 80.0% (2 instr)" in out and "100x: 20.0% (2 instr)" in out
    assert "stall reasons: wait 77.8%, long_sb 22.2%" in out
    assert out.splitlines()[-3].startswith("L 0x01010 60.00% notissued       40 exec        800  HMMA")


# --- one clean line for each bad argument -------------------------------------------------------------------

@pytest.mark.parametrize("args,words", [
    (("warm", "--spec", ""), "--spec: empty spec; expected key=value"),
    (("warm", "--spec", "   "), "--spec: empty spec; expected key=value"),
    (("warm", "--spec", "{}"), "--spec: "),
    (("warm", "--spec", "op=merge_state,head_dim=64,dtype=fp16", "--cache-dir", ""), "an empty --cache-dir"),
    (("cache", "list", "--cache-dir", ""), "an empty --cache-dir"),
    (("info", "--cache-dir", ""), "an empty --cache-dir"),
    (("warm", "--spec", "op=merge_state,head_dim=64,dtype=fp16", "--max-specs", "x"), "--max-specs"),
    (("cache", "frobnicate"), "invalid choice: 'frobnicate'"),
])
def test_a_bad_argument_is_one_error_line(tmp_path, args, words):
    proc = run_cli(*args, env=dict(os.environ, ATTNJIT_CACHE_DIR=str(tmp_path / "default")))
    assert proc.returncode in (1, 2)
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnjit: error: ") and words in lines[0], proc.stderr
    assert not (tmp_path / "default").exists(), "a rejected command touched the default cache"


def test_warm_of_an_absurd_catalog_says_the_count(tmp_path):
    catalog = tmp_path / "huge.toml"
    catalog.write_text('[[spec]]\nop = "prefill"\nhead_dim = [64, 128, 256]\npage_size = [1, 2, 4, 8, 16, 32, 64, 128]\n'
                       f'group_size = {list(range(1, 65))}\ndtype = ["fp16", "bf16"]\nmask = ["none", "causal"]\n'
                       'layout = ["NHD", "HND"]\nkv = ["paged", "paged"]\n'
                       'arch = ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a"]\n')
    proc = run_cli("warm", catalog, "--cache-dir", tmp_path / "cache", timeout=30)
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert "expands to 122,880 specs, more than the 100,000" in line and "--max-specs" in line
    proc = run_cli("render", catalog, "--max-specs", "10", timeout=30)
    assert proc.returncode == 1 and "more than the 10 a catalog may hold" in error_lines(proc.stderr)[0]


def test_cache_prune_keep_removes_what_the_catalogs_no_longer_build(golden, tmp_path):
    """prune --keep CATALOG: every entry the catalogs do not build now goes (keys rendered and hashed, no nvcc),
    listed first with --dry-run; the kept ones stay and still verify."""
    from attnjit.specs import dump_catalog

    root = golden.copy(tmp_path / "cache")
    catalog = tmp_path / "now.toml"
    catalog.write_text(dump_catalog([MERGE_FP16, APPEND_FP16]))
    proc = run_cli("cache", "prune", "--keep", catalog, "--dry-run", "--cache-dir", root)
    assert proc.returncode == 0, proc.stderr
    gone = {entry_dir(root, golden.key(s)) for s in (MERGE_BF16, PREFILL_D64)}
    assert {ln.split(" ", 2)[2] for ln in proc.stdout.splitlines()[:-1]} == {str(d) for d in gone}
    assert all(d.exists() for d in gone), "--dry-run removed something"
    proc = run_cli("cache", "prune", "--keep", catalog, "--cache-dir", root)
    assert proc.returncode == 0 and proc.stdout.startswith("removed 2 entries"), proc.stdout + proc.stderr
    cache = Cache(root, layers=())
    assert [s for s in golden.specs if cache.lookup(golden.key(s))] == [s for s in golden.specs
                                                                        if s in (MERGE_FP16, APPEND_FP16)]
    assert run_cli("cache", "verify", "--cache-dir", root).stdout.strip() == "2 entries checked, 0 bad"
    proc = run_cli("cache", "prune", "--cache-dir", root)
    assert proc.returncode == 2 and "--keep CATALOG" in proc.stderr


def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path):
    """`attnjit render ... | head -1`: a closed pipe exits 141 (as a command killed by SIGPIPE) with nothing on stderr."""
    import subprocess
    import sys

    # (the default catalog renders to megabytes: far more than a pipe's buffer holds)
    proc = subprocess.Popen([sys.executable, "-m", "attnjit.cli", "render", "default", "--arch", "sm_80"],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "ATTNJIT_CACHE_DIR": str(tmp_path)})
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait() == 141 and err == b""
