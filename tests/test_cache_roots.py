"""The cache's roots and layers: read-only roots and layers, permissions, lock timeouts, prune and clear, strict-mode
messages. (Keys, builds, concurrency, crashes and corruption are in test_cache.py.)"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
import time

import pytest

from attnjit import jit
from attnjit.cache import BadEntryWarning, Cache, Job
from attnjit.errors import CacheError, CacheMissError, CacheReadOnlyError, LockTimeoutError, UnsafeCacheError
from attnjit.specs import AttentionSpec
from attnjit.toolchain import flags_for
from tests.cpu_support import (APPEND_FP16, FAKE_NVCC, MERGE_BF16, MERGE_FP16, PREFILL_D64, REPO, TINY_SOURCE, cache_job,
                               entry_dir, flip_cubin_byte, holds_no_lock, parse_summary, snapshot)


# --- read-only roots and layers -------------------------------------------------------------------------------

@pytest.mark.nvcc
def test_read_only_root_serves_hits_and_refuses_builds(golden, tmp_path):
    root = golden.copy(tmp_path / "ro")
    root.chmod(0o555)
    try:
        before = snapshot(root)
        cache = Cache(root, layers=())
        assert not cache.root_writable()
        binary = jit.ensure(MERGE_FP16, cache)
        assert binary.how == "disk" and binary.entry.layer == root
        assert [r.status for r in cache.build([jit.job_for(s) for s in golden.specs])] == ["cached"] * 4
        missing = AttentionSpec(op="merge_state", head_dim=128, dtype="fp16")
        with pytest.raises(CacheReadOnlyError) as info:
            cache.build([jit.job_for(missing)])
        msg = str(info.value)
        assert f"cache root {root} is read-only; cannot build here" in msg and "ATTNJIT_CACHE_DIR" in msg
        with pytest.raises(CacheReadOnlyError):
            jit.ensure(missing, cache)
        with pytest.raises(CacheReadOnlyError, match="nothing was removed"):
            cache.clear()
        assert snapshot(root) == before, "the read-only root was written"
    finally:
        root.chmod(0o700)


@pytest.mark.nvcc
def test_read_only_layer_is_searched_after_the_root_and_never_written(golden, tmp_path, monkeypatch):
    layer = golden.copy(tmp_path / "layer")
    layer.chmod(0o555)
    root = tmp_path / "root"
    try:
        before = snapshot(layer)
        monkeypatch.setenv("ATTNJIT_CACHE_DIR", str(root))
        monkeypatch.setenv("ATTNJIT_CACHE_PATH", f"{tmp_path / 'absent'}:{layer}")
        cache = Cache()
        assert cache.root == root and cache.layers == (tmp_path / "absent", layer)
        entry = cache.lookup(golden.key(APPEND_FP16))
        assert entry is not None and entry.layer == layer and entry.dir == entry_dir(layer, golden.key(APPEND_FP16))
        monkeypatch.setenv("ATTNJIT_JIT", "0")  # strict mode is satisfied by a layer
        binary = jit.ensure(APPEND_FP16)
        assert binary.how == "disk" and binary.entry.layer == layer
        assert [r.status for r in Cache().build([jit.job_for(s) for s in golden.specs])] == ["cached"] * 4
        assert snapshot(layer) == before, "the read-only layer was written"
        assert not root.exists(), "a hit in a layer created the root"
        # the root comes first: an entry built there shadows the layer's
        monkeypatch.setenv("ATTNJIT_JIT", "1")
        built = Cache(root, layers=()).build([jit.job_for(MERGE_FP16)])[0]
        assert built.status == "built"
        assert Cache().lookup(golden.key(MERGE_FP16)).layer == root
    finally:
        layer.chmod(0o700)


@pytest.mark.nvcc
def test_strict_mode_miss_names_the_spec_and_the_command_that_warms_it(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("ATTNJIT_JIT", "0")
    cache = Cache(root, layers=())
    with pytest.raises(CacheMissError) as info:
        jit.ensure(MERGE_FP16, cache)
    err, msg = info.value, str(info.value)
    assert err.spec == MERGE_FP16 and err.key == jit.job_for(MERGE_FP16).key and err.searched == [root]
    assert MERGE_FP16.canonical() in msg and "ATTNJIT_JIT=0" in msg
    assert err.command in msg
    argv = shlex.split(err.command)
    assert argv[:2] == ["attnjit", "warm"] and argv[argv.index("--spec") + 1] == MERGE_FP16.as_flags()
    assert argv[argv.index("--cache-dir") + 1] == str(root)
    assert not root.exists(), "strict mode wrote to the cache"
    # run the printed command (through this interpreter rather than whichever `attnjit` is on PATH)
    proc = subprocess.run([sys.executable, "-m", "attnjit.cli", *argv[1:]], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert parse_summary(proc.stdout) == (1, 1, 0, 0)
    binary = jit.ensure(MERGE_FP16, Cache(root, layers=()))
    assert binary.how == "disk"


# --- permissions ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_root_other_users_can_write_is_refused(tmp_path, mode):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    cache = Cache(root, layers=())
    with pytest.raises(UnsafeCacheError) as info:
        cache.lookup("00" * 32)
    msg = str(info.value)
    assert f"cache root {root} is writable by other users (mode {mode:04o})" in msg and "chmod go-w" in msg
    with pytest.raises(UnsafeCacheError, match=re.escape(str(root))):
        Cache(root, layers=()).build([cache_job(TINY_SOURCE, tool=FAKE_NVCC)])


@pytest.mark.parametrize("sub", [".trash", ".tmp", ".locks", "failed"])
def test_a_symlinked_work_directory_in_the_root_is_refused_and_its_target_untouched(tmp_path, sub):
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir(mode=0o700)
    (outside / "build-0").mkdir(parents=True)   # what a cleaner of .trash or .tmp would remove
    (root / sub).symlink_to(outside)
    with pytest.raises(UnsafeCacheError, match=re.escape(f"{root / sub} is a symlink, not a directory")):
        Cache(root, layers=()).build([cache_job(TINY_SOURCE, tool=FAKE_NVCC)])
    assert [p.name for p in outside.iterdir()] == ["build-0"]


def test_a_symlinked_lock_file_is_named_not_a_bare_oserror(tmp_path):
    root, target = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir(mode=0o700)
    (root / ".locks").mkdir(mode=0o700)
    target.write_text("untouched")
    job = cache_job(TINY_SOURCE, tool=FAKE_NVCC)
    (root / ".locks" / f"{job.key}.lock").symlink_to(target)
    with pytest.raises(UnsafeCacheError, match=re.escape(f"lock file {root / '.locks' / job.key}.lock is a symlink")):
        Cache(root, layers=()).build([job])
    assert target.read_text() == "untouched"


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_layer_other_users_can_write_is_refused(tmp_path, mode):
    layer = tmp_path / "layer"
    layer.mkdir()
    layer.chmod(mode)
    cache = Cache(tmp_path / "root", layers=[layer])
    with pytest.raises(UnsafeCacheError, match=re.escape(f"cache layer {layer} is writable by other users")):
        cache.lookup("00" * 32)


def test_private_and_read_only_roots_are_accepted(tmp_path):
    for mode in (0o700, 0o755, 0o555):
        root = tmp_path / f"root-{mode:o}"
        root.mkdir()
        root.chmod(mode)
        assert Cache(root, layers=()).lookup("00" * 32) is None
        root.chmod(0o700)


def test_a_new_root_is_created_private(tmp_path):
    root = tmp_path / "a" / "b" / "cache"
    cache = Cache(root, layers=())
    cache._ensure_root()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert {p.name for p in root.iterdir()} == {".tmp", ".locks", ".trash", "failed", "CACHEDIR.TAG"}


# --- lock timeout -----------------------------------------------------------------------------------------------

def test_lock_timeout_names_the_lock_file(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    cache = Cache(root, layers=())
    cache._ensure_root()
    job = cache_job(TINY_SOURCE, tool=FAKE_NVCC)
    lock_path = root / ".locks" / f"{job.key}.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom filelock import FileLock\n"
         "lock = FileLock(sys.argv[1]); lock.acquire(); print('held', flush=True); time.sleep(120)\n",
         str(lock_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("ATTNJIT_LOCK_TIMEOUT", "1")
        t0 = time.monotonic()
        with pytest.raises(LockTimeoutError) as info:
            cache.build([job])
        waited = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert 1.0 <= waited < 10
    assert info.value.lock_path == lock_path and info.value.timeout == 1.0
    assert str(lock_path) in str(info.value) and "ATTNJIT_LOCK_TIMEOUT" in str(info.value)
    # the holder is gone: the lock is free again
    assert holds_no_lock(lock_path)


def test_bad_lock_timeout_setting_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNJIT_LOCK_TIMEOUT", "-3")
    with pytest.raises(ValueError, match=r"ATTNJIT_LOCK_TIMEOUT='-3' is invalid: expected a positive number"):
        Cache(tmp_path / "cache", layers=()).build([cache_job(TINY_SOURCE, tool=FAKE_NVCC)])


# --- prune and clear ------------------------------------------------------------------------------------------

@pytest.mark.nvcc
def test_prune_removes_least_recently_used_and_bad_entries_first(golden, tmp_path):
    root = golden.copy(tmp_path / "cache")
    cache = Cache(root, layers=())
    order = [MERGE_FP16, MERGE_BF16, APPEND_FP16, PREFILL_D64]  # oldest use first
    now = time.time()
    sizes = {}
    for i, spec in enumerate(order):
        entry = cache.lookup(golden.key(spec))
        os.utime(entry.cubin, (now - 1000 + 100 * i, now - 1000 + 100 * i))
        sizes[spec] = entry.bytes
    total = sum(sizes.values())
    assert cache.prune(total) == (0, total)
    # keep the two most recently used
    keep = sizes[APPEND_FP16] + sizes[PREFILL_D64]
    assert cache.prune(keep) == (2, keep)
    assert [s for s in order if cache.lookup(golden.key(s))] == [APPEND_FP16, PREFILL_D64]
    # a bad entry goes before an older good one
    flip_cubin_byte(entry_dir(root, golden.key(PREFILL_D64)))
    assert cache.prune(sizes[APPEND_FP16]) == (1, sizes[APPEND_FP16])
    assert cache.lookup(golden.key(APPEND_FP16)) is not None
    assert not entry_dir(root, golden.key(PREFILL_D64)).exists()
    assert cache.prune(0) == (1, 0)
    assert list(cache.iter_entries()) == []
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        cache.prune(-1)


@pytest.mark.nvcc
def test_clear_removes_root_entries_but_never_layers(golden, tmp_path):
    root = golden.copy(tmp_path / "root")
    layer = golden.copy(tmp_path / "layer")
    (root / "failed" / "junk").mkdir(parents=True)
    cache = Cache(root, layers=[layer])
    assert cache.clear() == 4
    assert [base for base, *_ in cache.iter_entries()] == [layer] * 4
    assert not (root / "failed").exists()
    assert cache.clear() == 0
    assert Cache(tmp_path / "never-made", layers=()).clear() == 0


def test_clear_removes_a_symlinked_shard_never_what_it_points_at(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "elsewhere" / "ab" / ("ab" * 32)
    root.mkdir(mode=0o700)
    outside.mkdir(parents=True)
    (outside / "keep").write_text("not the cache's")
    (root / "ab").symlink_to(outside.parent)
    cache = Cache(root, layers=())
    assert cache.verify() == [(root / "ab", f"untrusted: shard directory {root / 'ab'} is a symlink, not a directory")]
    assert cache.clear() == 1
    assert (outside / "keep").read_text() == "not the cache's" and not os.path.lexists(root / "ab")


def test_clear_and_prune_refuse_a_root_that_is_not_a_directory(tmp_path):
    """A file (or a dangling link) named as the root is a wrong path, not an empty cache: "removed 0" would hide it."""
    afile, dangling = tmp_path / "a-file", tmp_path / "dangling"
    afile.write_text("not a cache")
    dangling.symlink_to(tmp_path / "nowhere")
    for root, says in ((afile, "is not a directory"), (dangling, "is a dangling symlink")):
        cache = Cache(root, layers=())
        with pytest.raises(CacheError, match=says):
            cache.clear()
        with pytest.raises(CacheError, match=says):
            cache.prune(0)
    assert afile.read_text() == "not a cache"
    # a build names it for what it is (it said "of an unknown file type")
    with pytest.raises(CacheError, match=re.escape(f"{afile} is a regular file, not a directory")):
        Cache(afile, layers=()).build([Job(source="//\n", flags=flags_for("sm_90a"), arch="sm_90a", label="x",
                                           meta={})])


def test_a_layer_that_is_the_root_is_dropped(tmp_path, monkeypatch):
    """ATTNJIT_CACHE_PATH naming the root (directly or through a link) must not list each entry twice."""
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(root)
    other = tmp_path / "other"
    monkeypatch.setenv("ATTNJIT_CACHE_PATH", os.pathsep.join([str(root), str(tmp_path / "link"), str(other)]))
    monkeypatch.setenv("ATTNJIT_PACKAGES", "0")
    assert Cache(root).layers == (other,)


# --- strict-mode messages ---------------------------------------------------------------------------------------

@pytest.mark.nvcc
def test_a_strict_miss_on_a_bad_entry_says_it_was_bad_and_why(golden, tmp_path, monkeypatch):
    root = golden.copy(tmp_path / "cache")
    d = entry_dir(root, golden.key(MERGE_BF16))
    flip_cubin_byte(d)
    monkeypatch.setenv("ATTNJIT_JIT", "0")
    with pytest.warns(BadEntryWarning), pytest.raises(CacheMissError) as info:
        jit.ensure(MERGE_BF16, Cache(root, layers=()))
    err, msg = info.value, str(info.value)
    assert err.bad == ((d, err.bad[0][1]),) and err.bad[0][1].startswith("kernel.cubin sha256")
    assert msg.startswith(f"kernel in the cache is bad ({d}: kernel.cubin sha256 ")
    assert "ATTNJIT_JIT=0 forbids compiling" in msg and "not in the cache" not in msg and err.command in msg


@pytest.mark.nvcc
def test_a_strict_miss_for_a_main_variant_says_it_cannot_be_named(tmp_path, monkeypatch):
    import pickle

    from attnjit import Variant

    local = Variant("local_cap", params={"cap": float}, logits_transform="return cap * tanhf(logit / cap);")
    spec = AttentionSpec(op="prefill", head_dim=64, page_size=16, dtype="fp16", variant=local)
    monkeypatch.setenv("ATTNJIT_JIT", "0")
    with pytest.raises(CacheMissError) as info:
        jit.ensure(spec, Cache(tmp_path / "cache", layers=()))
    err, msg = info.value, str(info.value)
    assert err.command is None and "attnjit warm" not in msg
    assert "Its variant 'local_cap' was declared in __main__ (or not at module level), so no catalog or --spec can " \
           "name it" in msg and "attnjit.warm([spec])" in msg
    # the error pickles (a Variant itself does not yet, so check a plain spec's)
    plain = CacheMissError(MERGE_FP16, "ab" * 32, [tmp_path], None, bad=((tmp_path, "why"),), hint=err.hint)
    back = pickle.loads(pickle.dumps(plain))
    assert type(back) is CacheMissError and str(back) == str(plain) and back.bad == plain.bad
