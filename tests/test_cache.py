"""The content-addressed cache: key stability and sensitivity, atomic publication, one build per key across
processes, crash safety, corruption, nvcc discovery, compile errors. The ``nvcc``-marked tests compile real sm_90a
kernels. Roots, layers, permissions, lock timeouts, prune and clear: test_cache_roots.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import warnings
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from attnjit import jit
from attnjit.cache import (CACHE_FORMAT_VERSION, BadEntryWarning, Cache, Job, compute_key)
from attnjit.errors import CacheMissError, CompileError, NvccNotFoundError
from attnjit.generator import Rendered
from attnjit.specs import AttentionSpec
from attnjit.toolchain import Nvcc, find_nvcc, nvcc
from tests.cpu_support import (APPEND_FP16, MERGE_BF16, MERGE_FP16, PREFILL_D64, REPO, TINY_SOURCE, cache_job,
                               entry_dir, flip_cubin_byte, holds_no_lock, kill_tagged, nvcc_wrapper, parse_summary,
                               run_cli, write_script)

KEY_INPUTS = dict(source='extern "C" __global__ void k(int *p) { *p = 1; }\n', flags=("-cubin", "-O3"), arch="sm_90a")
BROKEN_SOURCE = '__global__ void k() { int x = ; }\n'


# --- keys ---------------------------------------------------------------------------------------------------

def test_key_is_a_sha256_hex_and_stable_across_processes():
    key = compute_key(**KEY_INPUTS)
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert compute_key(**KEY_INPUTS) == key
    script = ("import json, sys\nfrom attnjit.cache import compute_key\n"
              "d = json.loads(sys.argv[1]); d['flags'] = tuple(d['flags'])\nprint(compute_key(**d))\n")
    for seed in ("1", "987"):
        out = subprocess.run([sys.executable, "-c", script, json.dumps(KEY_INPUTS)], capture_output=True, text=True,
                             env=dict(os.environ, PYTHONHASHSEED=seed), check=True, timeout=60).stdout.strip()
        assert out == key, f"PYTHONHASHSEED={seed} gave another key"


CHANGES = {
    "source byte": dict(source=KEY_INPUTS["source"].replace("*p = 1", "*p = 2")),
    "source whitespace": dict(source=KEY_INPUTS["source"] + " "),
    "flag added": dict(flags=KEY_INPUTS["flags"] + ("-lineinfo",)),
    "flag changed": dict(flags=("-cubin", "-O2")),
    "flag order": dict(flags=("-O3", "-cubin")),
    "arch": dict(arch="sm_100a"),
    # fields are length-delimited: moving bytes across a boundary is a different key
    "flag boundary": dict(flags=("-cubin-O3",)),
    "flags/source boundary": dict(flags=("-cubin", "-O3e"), source=KEY_INPUTS["source"][1:]),
}


def test_every_key_input_changes_the_key():
    base = compute_key(**KEY_INPUTS)
    keys = {name: compute_key(**{**KEY_INPUTS, **change}) for name, change in CHANGES.items()}
    for name, key in keys.items():
        assert key != base, f"changing the {name} kept the key"
    assert len(set(keys.values())) == len(keys), "two different changes gave one key"


def test_nothing_but_the_key_inputs_changes_the_key(tmp_path):
    tool = Nvcc(Path("/opt/a/nvcc"), "Cuda compilation tools, release 13.0, V13.0.88")
    a = Job(source=KEY_INPUTS["source"], flags=KEY_INPUTS["flags"], nvcc=tool, arch="sm_90a", label="a",
            meta={"spec": {"op": "x"}}, context=object())
    # another label, manifest metadata, context, nvcc location and nvcc version (the toolchain policy): same key
    b = Job(source=KEY_INPUTS["source"], flags=KEY_INPUTS["flags"],
            nvcc=Nvcc(Path("/opt/b/nvcc"), "Cuda compilation tools, release 13.0, V13.0.48"),
            arch="sm_90a", label="b", meta={"note": 1}, context=None)
    assert a.key == b.key == compute_key(**KEY_INPUTS)
    # and the cache root only decides where the entry lives, not its name
    assert Cache(tmp_path / "r1", layers=()).entry_dir(tmp_path / "r1", a.key).name == \
        Cache(tmp_path / "r2", layers=()).entry_dir(tmp_path / "r2", a.key).name == a.key


@pytest.mark.nvcc
def test_spec_keys_are_stable_and_distinct(tmp_path, monkeypatch):
    spec = AttentionSpec(op="decode", head_dim=128, page_size=16, dtype="bf16", group_size=4)
    key = jit.job_for(spec).key
    assert jit.job_for(AttentionSpec.parse(spec.as_flags())).key == key
    assert jit.job_for(AttentionSpec(op="decode", head_dim=128, page_size=16, dtype="bfloat16",
                                     group_size=4)).key == key
    others = [spec.replace(**c) for c in ({"group_size": 8}, {"page_size": 1}, {"dtype_q": "fp16",
              "dtype_kv": "fp16", "dtype_o": "fp16"}, {"layout": "HND"}, {"arch": "sm_80"}, {"head_dim_qk": 64,
              "head_dim_vo": 64})]
    others.append(AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="bf16", group_size=4))
    keys = [jit.job_for(s).key for s in others]
    assert key not in keys and len(set(keys)) == len(keys)
    # the cache root is not part of the key; a fresh process computes the same key
    monkeypatch.setenv("ATTNJIT_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert jit.job_for(spec).key == key
    script = "import sys\nfrom attnjit import jit\nfrom attnjit.specs import AttentionSpec\n" \
             "print(jit.job_for(AttentionSpec.parse(sys.argv[1])).key)\n"
    out = subprocess.run([sys.executable, "-c", script, spec.canonical()], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONHASHSEED="77"), check=True, timeout=60).stdout.strip()
    assert out == key


def test_a_key_is_computed_without_any_nvcc(tmp_path, monkeypatch):
    """Rendering and keying a spec never looks for, or runs, nvcc (a serving host has none)."""
    ran = tmp_path / "nvcc-ran"
    poison = write_script(tmp_path / "poison-nvcc", f': > "{ran}"\nexit 1\n')
    keys = set()
    for env in ({"ATTNJIT_NVCC": str(poison)}, {"ATTNJIT_NVCC": str(tmp_path / "missing")}):
        monkeypatch.setenv("ATTNJIT_NVCC", env["ATTNJIT_NVCC"])
        job = jit.job_for(MERGE_FP16)
        assert job.nvcc is None
        keys.add(job.key)
    assert len(keys) == 1 and not ran.exists()


# --- nvcc discovery ---------------------------------------------------------------------------------------------

def test_explicit_nvcc_that_does_not_exist(tmp_path, monkeypatch):
    missing = tmp_path / "no" / "nvcc"
    monkeypatch.setenv("ATTNJIT_NVCC", str(missing))
    with pytest.raises(NvccNotFoundError, match=re.escape(f"ATTNJIT_NVCC={missing} (not an executable file)")):
        find_nvcc()
    # a miss with JIT on and no nvcc names the spec and says nvcc is missing (not a key failure)
    with pytest.raises(CacheMissError) as info:
        jit.ensure(MERGE_FP16, Cache(tmp_path / "cache", layers=()))
    err, msg = info.value, str(info.value)
    assert err.reason == "no-nvcc" and err.spec == MERGE_FP16 and MERGE_FP16.canonical() in msg
    assert msg.startswith("kernel not in the cache and nvcc is missing, so it cannot be built here (looked at "
                          f"ATTNJIT_NVCC={missing} (not an executable file))")
    assert err.command in msg and "set ATTNJIT_NVCC or CUDA_HOME" in msg


def test_no_nvcc_anywhere_names_all_three_places(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNJIT_NVCC", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(NvccNotFoundError) as info:
        find_nvcc()
    msg = str(info.value)
    assert "ATTNJIT_NVCC (unset)" in msg and "CUDA_HOME unset" in msg and "nvcc on PATH (none)" in msg
    assert info.value.tried == ["ATTNJIT_NVCC (unset)", "$CUDA_HOME/bin/nvcc (CUDA_HOME unset)",
                                "nvcc on PATH (none)"]
    # a CUDA_HOME without nvcc is named with the path that was tried
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    with pytest.raises(NvccNotFoundError, match=re.escape(f"$CUDA_HOME/bin/nvcc={tmp_path}/cuda/bin/nvcc (missing)")):
        find_nvcc()


def test_nvcc_search_order(tmp_path, monkeypatch):
    version = 'printf "Cuda compilation tools, release 12.8, V12.8.1\\n"\n'
    (tmp_path / "home" / "bin").mkdir(parents=True)
    (tmp_path / "path").mkdir()
    home_nvcc = write_script(tmp_path / "home" / "bin" / "nvcc", version)
    path_nvcc = write_script(tmp_path / "path" / "nvcc", version)
    explicit = write_script(tmp_path / "explicit-nvcc", version)
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("ATTNJIT_NVCC", raising=False)
    assert find_nvcc() == path_nvcc
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    assert find_nvcc() == home_nvcc
    monkeypatch.setenv("ATTNJIT_NVCC", str(explicit))
    assert find_nvcc() == explicit
    assert nvcc().release == "12.8"


# --- a real build ---------------------------------------------------------------------------------------------

@pytest.mark.nvcc
def test_build_publishes_a_complete_private_entry(tmp_path):
    root = tmp_path / "cache"
    cache = Cache(root, layers=())
    job = jit.job_for(MERGE_FP16)
    t0 = datetime.now(timezone.utc)
    (result,) = cache.build([job])
    assert result.status == "built", result.error
    key = job.key
    d = entry_dir(root, key)
    assert result.entry.dir == d and result.entry.layer == root and result.entry.key == key
    assert sorted(p.name for p in d.iterdir()) == ["build.log", "kernel.cu", "kernel.cubin", "manifest.json"]
    assert (d / "kernel.cu").read_text() == job.source
    cubin = (d / "kernel.cubin").read_bytes()
    assert cubin[:4] == b"\x7fELF", "kernel.cubin is not an ELF cubin"
    m = json.loads((d / "manifest.json").read_text())
    assert m["key"] == key and m["format"] == CACHE_FORMAT_VERSION
    assert AttentionSpec.from_dict(m["meta"]["spec"]) == MERGE_FP16
    assert m["key_inputs"] == {"arch": "sm_90a", "flags": list(job.flags),
                               "source_sha256": hashlib.sha256(job.source.encode()).hexdigest()}
    assert compute_key(source=job.source, flags=m["key_inputs"]["flags"], arch=m["key_inputs"]["arch"]) == key
    local = nvcc()  # the toolchain that built it is recorded, not keyed
    assert m["toolchain"] == {"id": local.ident, "release": local.release, "version": local.version,
                              "nvcc": str(local.path)}
    assert re.fullmatch(r"nvcc \d+\.\d+ V\d+(\.\d+)+", local.ident) and result.entry.toolchain == local.ident
    assert m["cubin_sha256"] == hashlib.sha256(cubin).hexdigest() and m["cubin_bytes"] == len(cubin)
    assert 0 < m["compile_seconds"] < 120 and result.seconds == pytest.approx(m["compile_seconds"], abs=1e-3)
    created = datetime.fromisoformat(m["created"])
    assert t0 - timedelta(seconds=2) <= created <= datetime.now(timezone.utc) + timedelta(seconds=2)
    # private: the root and the entry are 0700, the files 0600
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()} == {0o600}
    # nothing left behind in the temp area
    assert list((root / ".tmp").iterdir()) == []

    # the second build is a hit, and so is a lookup from another Cache and an ensure()
    (again,) = cache.build([job])
    assert again.status == "cached" and again.entry.dir == d and again.entry.manifest == m
    assert Cache(root, layers=()).lookup(key).manifest == m
    binary = jit.ensure(MERGE_FP16, Cache(root, layers=()))
    assert binary.how == "disk" and binary.compile_ms is None and binary.entry.dir == d


@pytest.mark.nvcc
def test_ensure_compiles_once(tmp_path):
    cache = Cache(tmp_path / "cache", layers=())
    first = jit.ensure(MERGE_FP16, cache)
    assert first.how == "built" and first.compile_ms > 0
    for _ in range(3):
        again = jit.ensure(MERGE_FP16, cache)
        assert again.how == "disk" and again.entry.dir == first.entry.dir
    # the same job listed twice in one build is one compile
    results = cache.build([jit.job_for(MERGE_BF16), jit.job_for(MERGE_BF16)])
    assert [r.status for r in results] == ["built", "built"] and results[0] is results[1]


@pytest.mark.nvcc
def test_one_failing_job_does_not_stop_the_others(tmp_path):
    root = tmp_path / "cache"
    good, bad = cache_job(TINY_SOURCE, label="tiny"), cache_job(BROKEN_SOURCE, label="broken")
    results = Cache(root, layers=()).build([good, bad])
    assert [r.status for r in results] == ["built", "failed"]
    ok, failed = results
    assert (ok.entry.dir / "kernel.cubin").is_file()
    err = failed.error
    assert isinstance(err, CompileError) and failed.entry is None
    assert "error" in err.first_error and "expected an expression" in err.first_error
    assert err.log_path == root / "failed" / bad.key / "build.log" and err.log_path.is_file()
    assert err.first_error in err.log_path.read_text()
    assert str(err).startswith(f"nvcc failed for broken: {err.first_error}") and str(err.log_path) in str(err)
    assert Cache(root, layers=()).lookup(bad.key) is None
    assert not entry_dir(root, bad.key).exists()


@pytest.mark.nvcc
def test_ensure_raises_the_compile_error_with_the_spec(tmp_path, monkeypatch):
    monkeypatch.setattr(jit, "render", lambda spec: Rendered(spec=spec, source=BROKEN_SOURCE, kernels={},
                                                              template="broken"))
    with pytest.raises(CompileError) as info:
        jit.ensure(MERGE_FP16, Cache(tmp_path / "cache", layers=()))
    err = info.value
    assert err.spec == MERGE_FP16 and MERGE_FP16.canonical() in str(err)
    assert "error" in err.first_error and err.log_path.is_file()


# --- concurrency and crashes ------------------------------------------------------------------------------------

@pytest.mark.nvcc
def test_concurrent_warms_build_each_key_once(tmp_path):
    root = tmp_path / "cache"
    specs = [MERGE_BF16, APPEND_FP16]
    args = [a for s in specs for a in ("--spec", s.as_flags())]
    cmd = [sys.executable, "-m", "attnjit.cli", "warm", *args, "--cache-dir", str(root)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    summaries = [parse_summary(out) for out, _ in outs]
    assert all(n == 2 and failed == 0 and built + cached == 2 for n, built, cached, failed in summaries)
    assert sum(s[1] for s in summaries) == 2 and sum(s[2] for s in summaries) == 4
    for spec in specs:
        builders = [i for i, (_, err) in enumerate(outs) if re.search(rf"^  built {re.escape(spec.short_name())} in ",
                                                                        err, re.M)]
        assert len(builders) == 1, f"{spec.short_name()} was built by processes {builders}"
    cache = Cache(root, layers=())
    assert cache.verify() == []
    assert sorted(key for _, key, entry, _ in cache.iter_entries() if entry) == \
        sorted(jit.job_for(s).key for s in specs)


@pytest.mark.nvcc
def test_a_cleaner_racing_a_new_build_dir_cannot_remove_it(tmp_path, monkeypatch):
    """Another process's stale-build cleanup may run the instant our temp build dir appears: the dir must
    already be locked then (a regression test: the dir used to be created before its lock)."""
    root = tmp_path / "cache"
    cache = Cache(root, layers=())
    real_mkdir = os.mkdir
    raced = []

    def mkdir_then_race(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        p = Path(path)
        if p.parent == root / ".tmp" and p.name.startswith("build-") and not raced:
            raced.append(p)
            Cache(root, layers=())._clean_stale_builds()  # what a concurrent `attnjit warm` does first

    monkeypatch.setattr(os, "mkdir", mkdir_then_race)
    (result,) = cache.build([cache_job(TINY_SOURCE, label="tiny")])
    assert raced, "the build made no temp dir"
    assert result.status == "built", result.error


@pytest.mark.nvcc
def test_killed_build_leaves_no_entry_and_the_next_warm_recovers(tmp_path):
    root = tmp_path / "cache"
    started = tmp_path / "nvcc-started"
    slow = nvcc_wrapper(tmp_path / "slow-nvcc", find_nvcc(), before_compile=f': > "{started}"\nsleep 60\n')
    spec = MERGE_FP16
    key = jit.job_for(spec).key
    tag = f"killed-build-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, ATTNJIT_NVCC=str(slow), ATTNJIT_TEST_TAG=tag)
    cmd = [sys.executable, "-m", "attnjit.cli", "warm", "--spec", spec.as_flags(), "--cache-dir", str(root)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert proc.poll() is None, "warm exited before nvcc started"
            assert time.monotonic() < deadline, "nvcc never started"
            time.sleep(0.05)
        assert list((root / ".tmp").glob(f"build-*/{key}/kernel.cu")), "no build in progress"
        os.kill(proc.pid, signal.SIGKILL)  # the builder dies mid-compile
        proc.wait(timeout=30)
    finally:
        kill_tagged(tag)  # and its ninja/nvcc children with it (each in a process group of its own)
    assert not entry_dir(root, key).exists(), "a killed build published an entry"
    with warnings.catch_warnings():
        warnings.simplefilter("error", BadEntryWarning)
        assert Cache(root, layers=()).lookup(key) is None
    assert Cache(root, layers=()).verify() == []
    assert holds_no_lock(root / ".locks" / f"{key}.lock"), "the dead builder's key lock is still held"
    stale = [p for p in (root / ".tmp").glob("build-*") if p.is_dir()]
    assert stale, "expected the killed build's temp dir"

    proc = run_cli("warm", "--spec", spec.as_flags(), "--cache-dir", root)
    assert proc.returncode == 0, proc.stderr
    assert parse_summary(proc.stdout) == (1, 1, 0, 0)
    assert list((root / ".tmp").iterdir()) == [], "the stale temp dir was not cleaned"
    entry = Cache(root, layers=()).lookup(key)
    assert entry is not None and entry.manifest["key"] == key


# --- corruption -------------------------------------------------------------------------------------------

def _truncate_cubin(d: Path) -> None:
    data = (d / "kernel.cubin").read_bytes()
    (d / "kernel.cubin").write_bytes(data[: len(data) // 2])


def _delete_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


def _garbage_manifest(d: Path) -> None:
    (d / "manifest.json").write_text('{"key": "0000", "format": ')


CORRUPTIONS = [  # (spec, how, what verify says)
    (MERGE_FP16, _truncate_cubin, "kernel.cubin sha256"),
    (MERGE_BF16, flip_cubin_byte, "kernel.cubin sha256"),
    (APPEND_FP16, _delete_manifest, "manifest.json missing"),
    (PREFILL_D64, _garbage_manifest, "manifest.json unreadable"),
]


@pytest.mark.nvcc
def test_corrupt_entries_are_reported_skipped_and_rebuilt(golden, tmp_path):
    root = golden.copy(tmp_path / "cache")
    dirs = {}
    for spec, corrupt, _ in CORRUPTIONS:
        dirs[spec] = entry_dir(root, golden.key(spec))
        corrupt(dirs[spec])

    proc = run_cli("cache", "verify", "--cache-dir", root)
    assert proc.returncode == 1
    for spec, _, problem in CORRUPTIONS:
        assert re.search(rf"^BAD {re.escape(str(dirs[spec]))}: {re.escape(problem)}", proc.stdout, re.M), proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "4 entries checked, 4 bad"

    cache = Cache(root, layers=())
    for spec, _, problem in CORRUPTIONS:
        with pytest.warns(BadEntryWarning, match=re.escape(str(dirs[spec]))):
            assert cache.lookup(golden.key(spec)) is None
    assert [(b.dir, b.problem.startswith(problem)) for b, (_, _, problem) in zip(cache.bad_entries, CORRUPTIONS)] \
        == [(dirs[spec], True) for spec, _, _ in CORRUPTIONS]

    proc = run_cli("warm", *[a for s, _, _ in CORRUPTIONS for a in ("--spec", s.as_flags())], "--cache-dir", root)
    assert proc.returncode == 0, proc.stderr
    assert parse_summary(proc.stdout) == (4, 4, 0, 0)
    proc = run_cli("cache", "verify", "--cache-dir", root)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "4 entries checked, 0 bad"
    with warnings.catch_warnings():
        warnings.simplefilter("error", BadEntryWarning)
        for spec, _, _ in CORRUPTIONS:
            assert Cache(root, layers=()).lookup(golden.key(spec)) is not None


def test_a_manifest_for_another_key_or_format_is_a_bad_entry(tmp_path):
    root = tmp_path / "cache"
    key = "ab" * 32
    d = entry_dir(root, key)
    d.mkdir(parents=True)
    (d / "kernel.cubin").write_bytes(b"\x7fELF")
    digest = hashlib.sha256(b"\x7fELF").hexdigest()
    cache = Cache(root, layers=())
    for manifest, problem in (({"key": "cd" * 32, "format": CACHE_FORMAT_VERSION, "cubin_sha256": digest},
                               "names another key"),
                              ({"key": key, "format": CACHE_FORMAT_VERSION + 1, "cubin_sha256": digest},
                               f"cache format {CACHE_FORMAT_VERSION + 1}"),
                              (["not", "a", "dict"], "names another key")):
        (d / "manifest.json").write_text(json.dumps(manifest))
        entry, found = cache.read_entry(root, key)
        assert entry is None and problem in found, found
        with pytest.warns(BadEntryWarning):  # a fresh Cache: one Cache reports each bad entry once
            assert Cache(root, layers=()).lookup(key) is None
    (d / "manifest.json").write_text(json.dumps({"key": key, "format": CACHE_FORMAT_VERSION, "cubin_sha256": digest}))
    assert cache.lookup(key).dir == d


@pytest.mark.parametrize("field, value, problem", [("label", None, "null, expected a string"),
                                                  ("compile_seconds", "slow", "a string, expected a number"),
                                                  ("toolchain", "nvcc", "a string, expected an object"),
                                                  ("key_inputs", [], "an array, expected an object")])
def test_a_manifest_field_of_the_wrong_type_is_a_bad_entry(tmp_path, field, value, problem):
    """``cache list``, ``pack`` and the dispatch record read these; a wrong type is a bad entry, not a traceback."""
    root = tmp_path / "cache"
    d = entry_dir(root, "ab" * 32)
    d.mkdir(parents=True)
    (d / "kernel.cubin").write_bytes(b"\x7fELF")
    (d / "manifest.json").write_text(json.dumps({"key": "ab" * 32, "format": CACHE_FORMAT_VERSION, field: value,
                                                 "cubin_sha256": hashlib.sha256(b"\x7fELF").hexdigest()}))
    entry, found = Cache(root, layers=()).read_entry(root, "ab" * 32)
    assert entry is None and found == f"manifest.json {field} is {problem}", found


@pytest.mark.parametrize("field, raw, problem", [
    ("compile_seconds", "1" + "0" * 400, "compile_seconds is not a duration"),   # float() overflows
    ("compile_seconds", "NaN", "compile_seconds is not a duration"),
    ("compile_seconds", "-3", "compile_seconds is not a duration"),
    ("label", json.dumps("x\nffffffffffffffff  totally-legit-kernel\u001b[31m"), "label holds control characters"),
    ("created", json.dumps("2026\u009b"), "created holds control characters"),
    ("toolchain", json.dumps({"id": "nvcc 13.0\nffffffffffffffff  forged-row"}), "toolchain id holds control")])
def test_a_manifest_field_cache_list_cannot_print_is_a_bad_entry(tmp_path, field, raw, problem):
    """A layer's manifest with a number cache list cannot format, or a string that would forge its rows or send
    terminal escapes, is a bad entry (reported as such), not a traceback or a forged row."""
    root = tmp_path / "cache"
    d = entry_dir(root, "ab" * 32)
    d.mkdir(parents=True)
    (d / "kernel.cubin").write_bytes(b"\x7fELF")
    body = json.dumps({"key": "ab" * 32, "format": CACHE_FORMAT_VERSION,
                       "cubin_sha256": hashlib.sha256(b"\x7fELF").hexdigest()})
    (d / "manifest.json").write_text(body[:-1] + f', "{field}": {raw}}}')
    entry, found = Cache(root, layers=()).read_entry(root, "ab" * 32)
    assert entry is None and found.startswith(f"manifest.json {problem}"), found


def test_a_bad_entrys_warning_carries_no_control_characters(tmp_path):
    """A bad entry's problem quotes what it found; a layer's forged manifest must not send terminal escapes through
    the warning a lookup emits (cache list / verify print it the same way)."""
    root = tmp_path / "cache"
    d = entry_dir(root, "ab" * 32)
    d.mkdir(parents=True)
    (d / "kernel.cubin").write_bytes(b"\x7fELF")
    (d / "manifest.json").write_text(json.dumps({"key": "ab" * 32, "format": "\u001b[2J\u009b31m"}))
    with pytest.warns(BadEntryWarning) as seen:
        assert Cache(root, layers=()).lookup("ab" * 32) is None
    text = str(seen[0].message)
    assert "?[2J" in text and not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in text), text


def test_a_manifest_nested_too_deeply_is_a_bad_entry_not_a_recursion_error(tmp_path):
    root = tmp_path / "cache"
    d = entry_dir(root, "ab" * 32)
    d.mkdir(parents=True)
    (d / "kernel.cubin").write_bytes(b"\x7fELF")
    (d / "manifest.json").write_text("[" * 100_000)  # well under the size limit
    entry, problem = Cache(root, layers=()).read_entry(root, "ab" * 32)
    assert entry is None and problem == "manifest.json unreadable: nested too deeply", problem
