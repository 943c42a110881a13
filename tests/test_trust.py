"""What the cache trusts: only files and directories owned by us (or root) that nobody else can write, read with no
symlink following, as regular files of bounded size, and loaded from the bytes that were verified.

Another user is simulated with a real ``chown`` when the suite runs as root (CI does), else by reporting one inode
as foreign (``trust._uid_of``). An unreadable file is a real ``chmod 000`` for a user, and an ``EACCES`` from
``os.open`` for root (whom modes do not stop). Every in-process test runs under a deadline, so a hang fails fast."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import signal
import stat
import warnings
from pathlib import Path

import pytest

from attnjit import jit, trust
from attnjit.cache import CACHE_FORMAT_VERSION, BadEntryWarning, Cache
from attnjit.errors import UnsafeCacheError
from tests.cpu_support import APPEND_FP16, MERGE_BF16, MERGE_FP16, PREFILL_D64, entry_dir, run_cli

IS_ROOT = os.geteuid() == 0
OTHER_UID = 54321
KEY = "ab" * 32
IMAGE = b"\x7fELF" + bytes(range(256)) * 4  # stands in for a cubin: lookups never parse it


@pytest.fixture(autouse=True)
def deadline(request):
    """Fail (not hang) a test that takes more than 30 s (180 s for one that compiles): a FIFO or device file must
    never block a lookup."""
    limit = 180 if request.node.get_closest_marker("nvcc") else 30

    def hung(_sig, _frame):
        raise AssertionError(f"a cache operation hung for {limit} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def make_foreign(monkeypatch):
    """make_foreign(path): from now on ``path`` is owned by another user."""
    foreign: set[tuple[int, int]] = set()
    real = trust._uid_of
    monkeypatch.setattr(trust, "_uid_of", lambda st: OTHER_UID if (st.st_dev, st.st_ino) in foreign else real(st))

    def make(path: Path) -> None:
        if IS_ROOT:
            os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)
        else:
            st = path.lstat()
            foreign.add((st.st_dev, st.st_ino))
    return make


@pytest.fixture
def make_unreadable(monkeypatch):
    """make_unreadable(path): opening ``path`` fails with EACCES (chmod 000 for a user; os.open refuses for root)."""
    denied: set[str] = set()
    real_open = os.open

    def guarded_open(name, flags, mode=0o777, *, dir_fd=None):
        full = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name) if dir_fd is not None else os.fspath(name)
        if os.path.normpath(full) in denied:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(name))
        return real_open(name, flags, mode, dir_fd=dir_fd)

    def make(path: Path) -> None:
        if IS_ROOT:
            denied.add(os.path.normpath(path))
            monkeypatch.setattr(os, "open", guarded_open)
        else:
            path.chmod(0)
    return make


def fake_entry(base: Path, key: str = KEY, image: bytes = IMAGE) -> Path:
    """A valid entry written by hand (no nvcc): private modes, a manifest naming the image's sha256."""
    d = entry_dir(base, key)
    d.mkdir(parents=True, mode=0o700)
    for p in (base, d.parent, d):
        p.chmod(0o700)
    (d / "kernel.cubin").write_bytes(image)
    (d / "manifest.json").write_text(json.dumps({"key": key, "format": CACHE_FORMAT_VERSION, "label": "fake",
                                                 "cubin_sha256": hashlib.sha256(image).hexdigest(),
                                                 "cubin_bytes": len(image)}))
    for p in d.iterdir():
        p.chmod(0o600)
    return d


def lookup_problem(cache: Cache, key: str = KEY) -> str | None:
    """The one warning a lookup gives (None if it hit), after checking that it missed and warned exactly once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry = cache.lookup(key)
    bad = [w for w in caught if issubclass(w.category, BadEntryWarning)]
    if entry is not None:
        assert not bad
        return None
    assert len(bad) == 1, [str(w.message) for w in bad]
    message = str(bad[0].message)
    assert "\n" not in message, "a bad entry is reported in one line"
    return message


# --- a valid entry, and what may not replace it ---------------------------------------------------------------

def test_a_private_entry_is_served_with_its_verified_bytes(tmp_path):
    d = fake_entry(tmp_path / "root")
    entry = Cache(tmp_path / "root", layers=()).lookup(KEY)
    assert entry is not None and entry.dir == d and entry.image == IMAGE


def test_a_layer_installed_by_root_or_a_package_manager_is_trusted(tmp_path):
    """0755 directories and 0644 files (what pip or tar leave) owned by us or root are fine: nobody else writes."""
    layer = tmp_path / "layer"
    d = fake_entry(layer)
    for p in (layer, d.parent, d):
        p.chmod(0o755)
    for p in d.iterdir():
        p.chmod(0o644)
    assert Cache(tmp_path / "root", layers=[layer]).lookup(KEY).image == IMAGE


@pytest.mark.parametrize("where", ["root", "layer"])
def test_a_root_or_layer_owned_by_another_user_is_refused(tmp_path, make_foreign, where):
    base = tmp_path / where
    fake_entry(base)
    base.chmod(0o755)
    make_foreign(base)
    cache = Cache(base, layers=()) if where == "root" else Cache(tmp_path / "mine", layers=[base])
    with pytest.raises(UnsafeCacheError) as info:
        cache.lookup(KEY)
    msg = str(info.value)
    assert f"cache {where} {base} is owned by " in msg and f"uid {OTHER_UID}" in msg and "not by you" in msg
    assert "\n" not in msg


FILE_AND_DIR = ["kernel.cubin", "manifest.json", "entry", "shard"]


def _target(d: Path, which: str) -> Path:
    return {"entry": d, "shard": d.parent}.get(which, d / which)


@pytest.mark.parametrize("which", FILE_AND_DIR)
def test_anything_in_an_entry_owned_by_another_user_is_refused(tmp_path, make_foreign, which):
    d = fake_entry(tmp_path / "layer")
    make_foreign(_target(d, which))
    problem = lookup_problem(Cache(tmp_path / "root", layers=[tmp_path / "layer"]))
    assert problem and f"uid {OTHER_UID}" in problem and "untrusted" in problem and str(d) in problem


@pytest.mark.parametrize("which,mode", [("kernel.cubin", 0o666), ("kernel.cubin", 0o620), ("manifest.json", 0o646),
                                        ("entry", 0o770), ("shard", 0o757)])
def test_anything_in_an_entry_others_can_write_is_refused(tmp_path, which, mode):
    d = fake_entry(tmp_path / "layer")
    _target(d, which).chmod(mode)
    problem = lookup_problem(Cache(tmp_path / "root", layers=[tmp_path / "layer"]))
    assert problem and f"is writable by other users (mode {mode:04o})" in problem


@pytest.mark.parametrize("which", ["kernel.cubin", "manifest.json", "entry", "shard"])
def test_symlinks_are_refused_not_followed(tmp_path, which):
    """A link to a perfectly valid copy is still refused: what is checked must be what is loaded."""
    d = fake_entry(tmp_path / "layer")
    target = _target(d, which)
    real = tmp_path / "elsewhere" / target.name
    real.parent.mkdir(mode=0o700)
    os.replace(target, real)
    target.symlink_to(real)
    problem = lookup_problem(Cache(tmp_path / "root", layers=[tmp_path / "layer"]))
    assert problem and "is a symlink" in problem


@pytest.mark.parametrize("which", ["kernel.cubin", "manifest.json"])
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "char device", "directory"])
def test_fifos_and_devices_never_hang_a_lookup_or_verify(tmp_path, which, kind):
    root = tmp_path / "root"
    d = fake_entry(root)
    path = d / which
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "char device":
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
        except OSError as exc:
            pytest.skip(f"cannot make a device node here: {exc.strerror}")
    else:
        path.mkdir(mode=0o700)
    cache = Cache(root, layers=())
    problem = lookup_problem(cache)
    expected = {"fifo": "is a FIFO", "link to /dev/zero": "is a symlink", "char device": "is a character device",
                "directory": "is a directory"}[kind]
    assert problem and f"{which} {expected}, not a regular file" in problem
    assert [(p, msg.startswith("untrusted")) for p, msg in cache.verify()] == [(d, True)]


@pytest.mark.parametrize("which,limit", [("kernel.cubin", trust.MAX_CUBIN_BYTES),
                                         ("manifest.json", trust.MAX_MANIFEST_BYTES)])
def test_an_oversized_file_is_refused_without_reading_it(tmp_path, which, limit):
    d = fake_entry(tmp_path / "root")
    with open(d / which, "r+b") as f:
        f.truncate(10 * 10**9)  # sparse: 10 GB that costs no disk
    problem = lookup_problem(Cache(tmp_path / "root", layers=()))
    assert problem and f"{which} is 10000000000 bytes, more than the {limit}" in problem


@pytest.mark.parametrize("which", ["kernel.cubin", "manifest.json", "entry"])
def test_an_unreadable_entry_is_a_miss_not_a_permission_error(tmp_path, make_unreadable, which):
    d = fake_entry(tmp_path / "root")
    make_unreadable(_target(d, which))
    try:
        problem = lookup_problem(Cache(tmp_path / "root", layers=()))
        assert problem and "unreadable: Permission denied" in problem and str(d) in problem
    finally:
        _target(d, which).chmod(0o700)


def test_a_file_that_changes_size_while_read_is_refused(tmp_path, monkeypatch):
    fake_entry(tmp_path / "root")
    real_fstat = os.fstat

    def shrunk_view(fd):  # the file claims to be larger than what can be read
        st = real_fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size == len(IMAGE):
            return os.stat_result((*st[:6], st.st_size + 10, *st[7:]))
        return st

    monkeypatch.setattr(os, "fstat", shrunk_view)
    problem = lookup_problem(Cache(tmp_path / "root", layers=()))
    assert problem and "changed size while being read" in problem


# --- the reader never opens a path twice -----------------------------------------------------------------------

def test_the_cubin_is_opened_once_without_following_links(tmp_path, monkeypatch):
    fake_entry(tmp_path / "root")
    opened = []
    real_open = os.open

    def spy(name, flags, mode=0o777, *, dir_fd=None):
        opened.append((os.fspath(name), flags, dir_fd is not None))
        return real_open(name, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", spy)
    entry = Cache(tmp_path / "root", layers=()).lookup(KEY)
    assert entry.image == IMAGE
    cubin_opens = [(flags, rel) for name, flags, rel in opened if name == "kernel.cubin"]
    assert len(cubin_opens) == 1, "the cubin was opened more than once"
    flags, relative = cubin_opens[0]
    assert relative and flags & os.O_NOFOLLOW and flags & os.O_NONBLOCK


# --- in the root: rebuilt; through the CLI: one line each -------------------------------------------------------

@pytest.mark.nvcc
def test_untrusted_and_unreadable_entries_in_the_root_are_rebuilt(golden, tmp_path, monkeypatch, make_foreign,
                                                                  make_unreadable):
    root = golden.copy(tmp_path / "cache")
    dirs = {s: entry_dir(root, golden.key(s)) for s in golden.specs}
    make_foreign(dirs[MERGE_FP16] / "kernel.cubin")
    (dirs[MERGE_BF16] / "kernel.cubin").chmod(0o666)
    link = dirs[APPEND_FP16] / "manifest.json"
    os.replace(link, tmp_path / "manifest.json")
    link.symlink_to(tmp_path / "manifest.json")
    make_unreadable(dirs[PREFILL_D64] / "kernel.cubin")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = jit.warm(list(golden.specs), Cache(root, layers=()))
    assert [r.status for r in results] == ["built"] * 4, [r.error for r in results]
    bad = [str(w.message) for w in caught if issubclass(w.category, BadEntryWarning)]
    assert len(bad) == 4 and all(re.search(r"ignoring (bad|untrusted) cache entry", m) for m in bad), bad
    monkeypatch.undo()  # the simulated owner and EACCES named the old entries' paths, where the new ones now are
    with warnings.catch_warnings():
        warnings.simplefilter("error", BadEntryWarning)
        for spec in golden.specs:
            entry = Cache(root, layers=()).lookup(golden.key(spec))
            assert entry is not None and entry.layer == root


def test_verify_reports_a_cubin_rewritten_by_another_user(tmp_path):
    """The issue's attack: a layer with 0755 directories and a 0666 cubin; someone rewrites the cubin and the
    sha256 in the manifest. Both still match each other; verify must still say the entry is untrusted."""
    layer = tmp_path / "layer"
    d = fake_entry(layer)
    for p in (layer, d.parent, d):
        p.chmod(0o755)
    (d / "manifest.json").chmod(0o644)
    cubin = d / "kernel.cubin"
    cubin.chmod(0o666)
    evil = b"\x7fELF evil"
    cubin.write_bytes(evil)
    m = json.loads((d / "manifest.json").read_text())
    m.update(cubin_sha256=hashlib.sha256(evil).hexdigest(), cubin_bytes=len(evil))
    (d / "manifest.json").write_text(json.dumps(m))
    env = dict(os.environ, ATTNJIT_CACHE_PATH=str(layer))
    proc = run_cli("cache", "verify", "--cache-dir", tmp_path / "root", env=env)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines() == [
        f"BAD {d}: untrusted: kernel.cubin is writable by other users (mode 0666); expected go-w",
        "1 entries checked, 1 bad"]


def test_one_cache_reports_a_bad_entry_once(tmp_path):
    d = fake_entry(tmp_path / "root")
    (d / "kernel.cubin").chmod(0o664)
    cache = Cache(tmp_path / "root", layers=())
    assert "writable by other users" in lookup_problem(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BadEntryWarning)
        assert cache.lookup(KEY) is None  # the second lookup of the same bad entry stays quiet
    assert len(cache.bad_entries) == 1


@pytest.mark.nvcc
def test_warm_over_a_fifo_rebuilds_it_with_one_warning_line(golden, tmp_path):
    root = golden.copy(tmp_path / "cache")
    d = entry_dir(root, golden.key(MERGE_FP16))
    (d / "kernel.cubin").unlink()
    os.mkfifo(d / "kernel.cubin", 0o600)
    proc = run_cli("cache", "verify", "--cache-dir", root, timeout=60)
    assert proc.returncode == 1 and f"BAD {d}: untrusted: kernel.cubin is a FIFO, not a regular file" in proc.stdout
    proc = run_cli("warm", "--spec", MERGE_FP16.as_flags(), "--cache-dir", root, timeout=120)
    assert proc.returncode == 0, proc.stderr
    warning_lines = [ln for ln in proc.stderr.splitlines() if "warning" in ln or "FIFO" in ln]
    assert warning_lines == [f"attnjit: warning: ignoring untrusted cache entry {d}: kernel.cubin is a FIFO, not a "
                             "regular file (a build replaces it)"], proc.stderr
    assert "Traceback" not in proc.stderr
    assert stat.S_ISREG((d / "kernel.cubin").lstat().st_mode)
