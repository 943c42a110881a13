"""Content-addressed store of compiled kernels.

Key = sha256(cache format version, target arch, nvcc flags, ``nvcc --version``, rendered source). An entry is
``<root>/<key[:2]>/<key>/`` holding ``kernel.cubin``, ``kernel.cu``, ``build.log`` and ``manifest.json``.

Contracts:
  * Publication is atomic: an entry is built in ``<root>/.tmp/``, its manifest written last, and the directory
    moved into place with one ``os.replace``. A reader sees a whole entry or none; a process killed mid-build
    leaves only a temp directory that the next build removes.
  * One ``filelock`` per key (``<root>/.locks/<key>.lock``): concurrent processes build each key once. The OS
    releases a dead process's lock. Lookups take no lock.
  * On lookup the cubin's sha256 is checked against the manifest; a bad entry is reported and treated as a
    miss, and the next build replaces it.
  * Trust (``trust``): only what the current user (or root) owns and nobody else can write is used: the root and
    each layer (else ``UnsafeCacheError``), the shard and entry directories and every file (else a bad entry, a
    miss). Entry files are opened without following symlinks, must be regular files of bounded size, and are read
    once: the cubin bytes that were hashed are the bytes handed to the loader (``Entry.image``).
  * The root is created private (0700), its entries 0700/0600.

This module knows nothing about attention: it stores what it is given under the key of what it is given.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
import uuid
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from filelock import FileLock, Timeout

from . import knobs
from .errors import CacheReadOnlyError, CompileError, LockTimeoutError, UnsafeCacheError
from .toolchain import Nvcc
from .trust import (MAX_CUBIN_BYTES, MAX_MANIFEST_BYTES, Untrusted, check_tree_top, open_dir, ownership_problem,
                    read_file)

CACHE_FORMAT_VERSION = 1
CUBIN, SOURCE, LOG, MANIFEST = "kernel.cubin", "kernel.cu", "build.log", "manifest.json"
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")


class BadEntryWarning(UserWarning):
    """A cache entry failed verification and was ignored (it is rebuilt on the next build)."""


def default_root() -> Path:
    return knobs.CACHE_DIR.get() or Path.home() / ".cache" / "attnjit"


def compute_key(*, source: str, flags: Sequence[str], nvcc_version: str, arch: str) -> str:
    h = hashlib.sha256()
    for part in (f"attnjit-cache-format-{CACHE_FORMAT_VERSION}", arch, "\x00".join(flags), nvcc_version, source):
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Job:
    """One thing to build: its source and everything in its key. ``context`` travels into errors untouched."""

    source: str
    flags: tuple[str, ...]
    nvcc: Nvcc
    arch: str
    label: str                      # readable name for progress lines and errors
    meta: dict[str, Any]            # stored in the manifest (e.g. the canonical spec)
    context: Any = field(default=None, compare=False)

    @property
    def key(self) -> str:
        return compute_key(source=self.source, flags=self.flags, nvcc_version=self.nvcc.version, arch=self.arch)


def _dir_bytes(d: Path) -> int:
    """Bytes of the regular files directly in ``d`` (lstat: never follows a link, never opens a file)."""
    total = 0
    try:
        for p in d.iterdir():
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    except OSError:
        pass
    return total


@dataclass(frozen=True)
class Entry:
    key: str
    dir: Path
    layer: Path         # the root or read-only layer it was found in
    manifest: dict[str, Any]
    image: bytes = field(default=b"", repr=False, compare=False)  # the verified cubin bytes: load these

    @property
    def cubin(self) -> Path:
        return self.dir / CUBIN

    @property
    def bytes(self) -> int:
        return _dir_bytes(self.dir)


@dataclass
class BuildResult:
    job: Job
    status: str                     # built | cached | failed
    entry: Entry | None = None
    seconds: float | None = None    # compile seconds (built)
    error: CompileError | None = None


@dataclass(frozen=True)
class BadEntry:
    dir: Path
    problem: str


def _first_error_line(log: str) -> str:
    for line in log.splitlines():
        if re.search(r"\berror\b", line, re.I):
            return line.strip()
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return lines[-1] if lines else "nvcc failed without output"


def _ninja_binary() -> str:
    try:
        import ninja  # type: ignore

        cand = Path(ninja.BIN_DIR) / "ninja"
        if cand.is_file():
            return str(cand)
    except ImportError:
        pass
    found = shutil.which("ninja")
    if not found:
        raise FileNotFoundError("ninja not found: pip install ninja")
    return found


def _ninja_escape(text: str) -> str:
    return text.replace("$", "$$").replace("\n", "$\n")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Cache:
    """A writable root plus read-only layers searched after it."""

    def __init__(self, root: Path | str | None = None, layers: Sequence[Path | str] | None = None):
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.layers = tuple(Path(p).expanduser() for p in (layers if layers is not None else knobs.CACHE_PATH.get()))
        self.bad_entries: list[BadEntry] = []   # reported by lookups, for callers that want them
        self._checked: set[Path] = set()

    # --- safety -------------------------------------------------------------------------------------------

    def _what(self, base: Path) -> str:
        return "cache root" if base == self.root else "cache layer"

    def _check_safe(self, path: Path, what: str) -> None:
        """Refuse a root or layer that another user owns or that others can write (like ssh with a key file)."""
        if path in self._checked:
            return
        try:
            st = check_tree_top(path, what)
        except Untrusted as exc:
            raise UnsafeCacheError(
                f"{exc}; a cubin from it would run on the GPU. Use a directory you own with "
                f"chmod go-w {shlex.quote(str(path))}, or have root own a shared read-only layer "
                "(ATTNJIT_CACHE_PATH).") from None
        if st is not None:
            self._checked.add(path)

    def root_writable(self) -> bool:
        """The root (or, if it does not exist yet, its nearest existing parent) can be written by us."""
        probe = self.root
        while not probe.exists():
            if probe.parent == probe:
                return False
            probe = probe.parent
        try:
            mode = probe.stat().st_mode
        except OSError:
            return False
        # a directory whose owner removed its own write bit is read-only, also for root
        return os.access(probe, os.W_OK | os.X_OK) and bool(mode & stat.S_IWUSR)

    def _ensure_root(self) -> None:
        if not self.root_writable():
            raise CacheReadOnlyError(
                f"cache root {self.root} is read-only; cannot build here. Point ATTNJIT_CACHE_DIR (or --cache-dir) at "
                "a writable directory, or pre-warm this cache where it is writable.")
        created = not self.root.exists()
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if created:
                os.chmod(self.root, 0o700)
        except OSError as exc:
            raise CacheReadOnlyError(f"cannot create cache root {self.root}: {exc.strerror or exc}") from None
        self._check_safe(self.root, "cache root")
        for sub in (".tmp", ".locks", ".trash", "failed"):
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)

    # --- reading ------------------------------------------------------------------------------------------

    def search_path(self) -> list[Path]:
        return [self.root, *self.layers]

    @staticmethod
    def entry_dir(base: Path, key: str) -> Path:
        return base / key[:2] / key

    def read_entry(self, base: Path, key: str) -> tuple[Entry | None, str | None]:
        """(entry, None) if valid, (None, problem) if present but bad or untrusted, (None, None) if absent.

        The base itself must already have passed ``_check_safe``; an untrusted base raises UnsafeCacheError.
        """
        d = self.entry_dir(base, key)
        try:
            with ExitStack() as stack:
                try:
                    bfd = stack.enter_context(open_dir(base, f"{self._what(base)} {base}", follow=True))
                except Untrusted as exc:
                    raise UnsafeCacheError(f"{exc}; a cubin from it would run on the GPU") from None
                sfd = stack.enter_context(open_dir(key[:2], f"shard directory {d.parent}", dir_fd=bfd))
                efd = stack.enter_context(open_dir(key, "entry directory", dir_fd=sfd))
                return self._read_files(efd, base, key, d)
        except FileNotFoundError:
            return None, None
        except Untrusted as exc:
            return None, f"untrusted: {exc}"
        except OSError as exc:
            return None, f"unreadable: {exc.strerror or exc}"

    def _read_files(self, efd: int, base: Path, key: str, d: Path) -> tuple[Entry | None, str | None]:
        try:
            manifest = json.loads(read_file(efd, MANIFEST, MANIFEST, MAX_MANIFEST_BYTES).decode("utf-8"))
        except FileNotFoundError:
            return None, "manifest.json missing"
        except (ValueError, UnicodeDecodeError) as exc:
            return None, f"manifest.json unreadable: {exc}"
        except PermissionError as exc:
            return None, f"manifest.json unreadable: {exc.strerror}"
        if not isinstance(manifest, dict) or manifest.get("key") != key:
            return None, "manifest.json names another key"
        if manifest.get("format") != CACHE_FORMAT_VERSION:
            return None, f"cache format {manifest.get('format')} (expected {CACHE_FORMAT_VERSION})"
        try:
            image = read_file(efd, CUBIN, CUBIN, MAX_CUBIN_BYTES)
        except FileNotFoundError:
            return None, "kernel.cubin missing"
        except PermissionError as exc:
            return None, f"kernel.cubin unreadable: {exc.strerror}"
        digest = hashlib.sha256(image).hexdigest()
        if digest != manifest.get("cubin_sha256"):
            return None, (f"kernel.cubin sha256 {digest[:16]} does not match the manifest's "
                          f"{str(manifest.get('cubin_sha256'))[:16]}")
        return Entry(key=key, dir=d, layer=base, manifest=manifest, image=image), None

    def lookup(self, key: str) -> Entry | None:
        """The first valid entry for ``key`` in the root, then the layers. Bad entries are reported and skipped."""
        for base in self.search_path():
            self._check_safe(base, self._what(base))
            entry, problem = self.read_entry(base, key)
            if entry is not None:
                return entry
            if problem is not None:
                bad = BadEntry(self.entry_dir(base, key), problem)
                if bad not in self.bad_entries:  # one line per bad entry, however often it is looked up
                    self.bad_entries.append(bad)
                    kind = "untrusted" if problem.startswith("untrusted: ") else "bad"
                    fix = ("a build replaces it" if base == self.root else
                           "layers are read-only: fix or remove it there; a build puts a good copy in the root")
                    warnings.warn(f"attnjit: ignoring {kind} cache entry {bad.dir}: "
                                  f"{problem.removeprefix('untrusted: ')} ({fix})", BadEntryWarning, stacklevel=3)
        return None

    @staticmethod
    def row_dir(base: Path, key: str) -> Path:
        """The directory an ``iter_entries`` row names (an entry, or a shard that could not be listed)."""
        return base / key if len(key) == 2 else base / key[:2] / key

    def iter_entries(self, bases: Iterable[Path] | None = None) -> Iterable[tuple[Path, str, Entry | None, str | None]]:
        """(base, key, entry, problem) for every entry directory under the given bases (default: all).

        A shard directory that cannot be listed is one row whose key is the shard's two-hex-digit name."""
        for base in (bases if bases is not None else self.search_path()):
            self._check_safe(base, self._what(base))
            if not base.is_dir():
                continue
            for shard in sorted(base.iterdir()):
                if not re.fullmatch(r"[0-9a-f]{2}", shard.name) or not shard.is_dir():
                    continue
                try:
                    names = sorted(p.name for p in shard.iterdir())
                except OSError as exc:
                    yield base, shard.name, None, f"shard directory unreadable: {exc.strerror or exc}"
                    continue
                for name in names:
                    if _KEY_RE.match(name) and name.startswith(shard.name):
                        entry, problem = self.read_entry(base, name)
                        yield base, name, entry, problem

    # --- building -----------------------------------------------------------------------------------------

    def _lock(self, key: str) -> FileLock:
        return FileLock(str(self.root / ".locks" / f"{key}.lock"))

    def _clean_stale_builds(self) -> None:
        """Remove temp build directories whose builder is gone (its lock is free)."""
        tmp = self.root / ".tmp"
        for d in tmp.glob("build-*"):
            if not d.is_dir():
                continue
            lock = FileLock(str(d) + ".lock")
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue
            try:
                shutil.rmtree(d, ignore_errors=True)
            finally:
                lock.release()
                Path(str(d) + ".lock").unlink(missing_ok=True)
        trash = self.root / ".trash"
        for d in trash.iterdir() if trash.is_dir() else ():
            shutil.rmtree(d, ignore_errors=True)

    def build(self, jobs: Sequence[Job], *, parallel: int | None = None,
              progress: Callable[[str], None] | None = None) -> list[BuildResult]:
        """Make sure every job has a valid entry: reuse what exists, build the rest (in parallel, via ninja).

        Returns one result per job, in order. Failures are results (status ``failed`` with ``error``), not
        exceptions, so one bad spec does not stop a pre-warm of many.
        """
        say = progress or (lambda _msg: None)
        by_key: dict[str, BuildResult] = {}
        order = []
        for job in jobs:
            key = job.key
            order.append(key)
            if key in by_key:
                continue
            entry = self.lookup(key)
            by_key[key] = BuildResult(job, "cached", entry) if entry else BuildResult(job, "pending")
        pending = [r.job for r in by_key.values() if r.status == "pending"]
        if pending:
            self._ensure_root()
            self._clean_stale_builds()
        timeout = knobs.LOCK_TIMEOUT.get()
        while pending:
            mine: list[tuple[Job, FileLock]] = []
            theirs: list[Job] = []
            for job in pending:
                lock = self._lock(job.key)
                try:
                    lock.acquire(timeout=0)
                except Timeout:
                    theirs.append(job)
                    continue
                entry = self.lookup(job.key)  # built by someone else since we looked
                if entry is not None:
                    lock.release()
                    by_key[job.key] = BuildResult(job, "cached", entry)
                else:
                    mine.append((job, lock))
            try:
                if mine:
                    for result in self._build_locked([j for j, _ in mine], parallel, say):
                        by_key[result.job.key] = result
            finally:
                for _, lock in mine:
                    lock.release()
            pending = []
            for job in theirs:
                say(f"waiting for another process building {job.label}")
                lock = self._lock(job.key)
                try:
                    lock.acquire(timeout=timeout)
                except Timeout:
                    raise LockTimeoutError(Path(lock.lock_file), timeout) from None
                try:
                    entry = self.lookup(job.key)
                finally:
                    lock.release()
                if entry is not None:
                    by_key[job.key] = BuildResult(job, "cached", entry)
                else:
                    pending.append(job)  # the other process failed or died: build it ourselves
        return [by_key[k] for k in order]

    def _build_locked(self, jobs: list[Job], parallel: int | None, say: Callable[[str], None]) -> list[BuildResult]:
        """Build jobs whose key locks we hold, through one ninja run, and publish each success atomically."""
        # Take the temp dir's lock before the dir exists: another process's _clean_stale_builds removes any
        # build-* dir whose lock is free, so a dir created before its lock could vanish under us.
        bdir = self.root / ".tmp" / f"build-{uuid.uuid4().hex[:16]}"
        blk = FileLock(str(bdir) + ".lock")
        blk.acquire()
        try:
            bdir.mkdir(mode=0o700)
            return self._run_ninja(bdir, jobs, parallel, say)
        finally:
            shutil.rmtree(bdir, ignore_errors=True)
            blk.release()
            Path(str(bdir) + ".lock").unlink(missing_ok=True)

    def _run_ninja(self, bdir: Path, jobs: list[Job], parallel: int | None,
                   say: Callable[[str], None]) -> list[BuildResult]:
        lines = ["ninja_required_version = 1.3", "", "rule nvcc",
                 "  command = $nvcc $flags -o $out.part $in > $log 2>&1 && mv -f $out.part $out",
                 "  description = $label", ""]
        for job in jobs:
            d = bdir / job.key
            d.mkdir()
            (d / SOURCE).write_text(job.source, encoding="utf-8")
            lines += [f"build {job.key}/{CUBIN}: nvcc {job.key}/{SOURCE}",
                      f"  nvcc = {_ninja_escape(shlex.quote(str(job.nvcc.path)))}",
                      f"  flags = {_ninja_escape(' '.join(shlex.quote(f) for f in job.flags))}",
                      f"  log = {job.key}/{LOG}",
                      f"  label = {_ninja_escape(job.label)}", ""]
        (bdir / "build.ninja").write_text("\n".join(lines), encoding="utf-8")
        jobs_n = parallel or knobs.JOBS.get() or os.cpu_count() or 1
        env = dict(os.environ, NINJA_STATUS="[%f/%t done, %es] ")
        say(f"compiling {len(jobs)} kernel module(s) with {jobs_n} parallel nvcc job(s)")
        t0 = time.monotonic()
        proc = subprocess.Popen([_ninja_binary(), "-k", "0", "-j", str(jobs_n)], cwd=bdir, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line.startswith("["):
                say(f"  {line}")
        proc.wait()
        wall = time.monotonic() - t0
        durations = self._ninja_durations(bdir)
        results = []
        for job in jobs:
            d = bdir / job.key
            cubin = d / CUBIN
            log_text = (d / LOG).read_text(encoding="utf-8", errors="replace") if (d / LOG).exists() else ""
            seconds = durations.get(f"{job.key}/{CUBIN}", wall)
            if cubin.is_file() and cubin.stat().st_size > 0:
                entry = self._publish(job, d, seconds)
                say(f"  built {job.label} in {seconds:.1f} s")
                results.append(BuildResult(job, "built", entry, seconds))
            else:
                failed = self.root / "failed" / job.key
                shutil.rmtree(failed, ignore_errors=True)
                os.replace(d, failed)
                error = CompileError(job.context, job.label, _first_error_line(log_text), failed / LOG, log_text)
                say(f"  FAILED {job.label}: {error.first_error}")
                results.append(BuildResult(job, "failed", None, seconds, error))
        return results

    @staticmethod
    def _ninja_durations(bdir: Path) -> dict[str, float]:
        out: dict[str, float] = {}
        log = bdir / ".ninja_log"
        if log.exists():
            for line in log.read_text().splitlines():
                parts = line.split("\t")
                if len(parts) >= 4 and not line.startswith("#"):
                    out[parts[3]] = (int(parts[1]) - int(parts[0])) / 1000.0
        return out

    def _publish(self, job: Job, d: Path, seconds: float) -> Entry:
        cubin = d / CUBIN
        manifest = {
            "format": CACHE_FORMAT_VERSION,
            "key": job.key,
            "label": job.label,
            "meta": job.meta,
            "key_inputs": {"arch": job.arch, "flags": list(job.flags), "nvcc_version": job.nvcc.version,
                           "source_sha256": hashlib.sha256(job.source.encode("utf-8")).hexdigest()},
            "nvcc_path": str(job.nvcc.path),
            "cubin_sha256": _sha256_file(cubin),
            "cubin_bytes": cubin.stat().st_size,
            "compile_seconds": round(seconds, 3),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": sys.version.split()[0],
        }
        _fsync(cubin)
        tmp_manifest = d / (MANIFEST + ".part")
        tmp_manifest.write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
        _fsync(tmp_manifest)
        os.replace(tmp_manifest, d / MANIFEST)   # the manifest is the commit marker, written last
        for p in d.iterdir():
            os.chmod(p, 0o600)
        os.chmod(d, 0o700)
        image = cubin.read_bytes()  # our own private file, just written
        shard = self.root / job.key[:2]
        try:
            st = shard.lstat()
            if not stat.S_ISDIR(st.st_mode) or ownership_problem(st, "shard"):
                self._discard(shard)  # a link, a file or a foreign directory: never publish through it
        except FileNotFoundError:
            pass
        shard.mkdir(mode=0o700, exist_ok=True)
        dest = shard / job.key
        if os.path.lexists(dest):  # a bad entry (we hold the key's lock, and lookup rejected it)
            self._discard(dest)
        os.replace(d, dest)
        _fsync(shard)
        return Entry(key=job.key, dir=dest, layer=self.root, manifest=manifest, image=image)

    def _discard(self, path: Path) -> None:
        """Move a root entry (or a bad shard) into .trash, where it is removed; works on unreadable entries too."""
        if path.is_dir() and not path.is_symlink():
            try:  # moving a directory updates its "..": it must be writable
                os.chmod(path, 0o700)
            except OSError:
                pass
        trash = self.root / ".trash"
        trash.mkdir(mode=0o700, exist_ok=True)
        os.replace(path, trash / f"{path.name}-{uuid.uuid4().hex[:8]}")

    # --- maintenance ----------------------------------------------------------------------------------------

    def verify(self) -> list[tuple[Path, str]]:
        """(entry dir, problem) for every bad entry in the root and the layers."""
        return [(self.row_dir(base, key), problem) for base, key, entry, problem in self.iter_entries()
                if entry is None]

    def clear(self) -> int:
        """Remove every entry of the root (never the layers). Returns how many."""
        if not self.root.is_dir():
            return 0
        if not self.root_writable():
            raise CacheReadOnlyError(f"cache root {self.root} is read-only; nothing was removed")
        n = 0
        (self.root / ".trash").mkdir(mode=0o700, exist_ok=True)
        for base, key, _entry, _problem in list(self.iter_entries([self.root])):
            self._discard(self.row_dir(base, key))
            n += 1
        shutil.rmtree(self.root / ".trash", ignore_errors=True)
        shutil.rmtree(self.root / "failed", ignore_errors=True)
        return n

    def prune(self, max_bytes: int) -> tuple[int, int]:
        """Remove least recently used root entries until the root's entries total at most max_bytes.

        Returns (entries removed, bytes remaining). Bad entries go first.
        """
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        items = []
        for base, key, entry, _problem in self.iter_entries([self.root]):
            d = self.row_dir(base, key)
            size = _dir_bytes(d)
            try:  # last use = the cubin's mtime, which touch() sets on every load (reading it for the
                used = (d / CUBIN).lstat().st_mtime  # sha256 check moves only the atime)
            except OSError:
                used = 0.0
            items.append((entry is not None, used, size, d, key))
        total = sum(i[2] for i in items)
        items.sort(key=lambda i: (i[0], i[1]))  # bad entries first, then oldest use
        removed = 0
        if total > max_bytes and not self.root_writable():
            raise CacheReadOnlyError(f"cache root {self.root} is read-only; nothing was pruned")
        for _valid, _used, size, d, key in items:
            if total <= max_bytes:
                break
            self._discard(d)
            total -= size
            removed += 1
        shutil.rmtree(self.root / ".trash", ignore_errors=True)
        return removed, total

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for base in self.search_path():
            count = size = 0
            for b, key, entry, _problem in self.iter_entries([base]):
                count += 1
                size += _dir_bytes(self.row_dir(b, key))
            out[str(base)] = {"entries": count, "bytes": size, "exists": base.is_dir()}
        return out


def touch(entry: Entry) -> None:
    """Record a use (for prune's LRU order); silently skipped where the entry is read-only."""
    try:
        os.utime(entry.cubin, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
