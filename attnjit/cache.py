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
  * The root is created private (0700). A root or read-only layer (``ATTNJIT_CACHE_PATH``) that other users can
    write is refused: loading a cubin runs its code on the GPU.

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
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from filelock import FileLock, Timeout

from . import knobs
from .errors import CacheReadOnlyError, CompileError, LockTimeoutError, UnsafeCacheError
from .toolchain import Nvcc

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


@dataclass(frozen=True)
class Entry:
    key: str
    dir: Path
    layer: Path         # the root or read-only layer it was found in
    manifest: dict[str, Any]

    @property
    def cubin(self) -> Path:
        return self.dir / CUBIN

    @property
    def bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.iterdir() if p.is_file())


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

    def _check_safe(self, path: Path, what: str) -> None:
        """Refuse a directory that users other than its owner can write (like ssh with a key file)."""
        if path in self._checked:
            return
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafeCacheError(
                f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}); a cubin from it "
                f"would run on the GPU. Make it private (chmod go-w {shlex.quote(str(path))}), or keep a shared "
                "cache read-only and list it in ATTNJIT_CACHE_PATH.")
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
        """(entry, None) if valid, (None, problem) if present but bad, (None, None) if absent."""
        d = self.entry_dir(base, key)
        if not d.is_dir():
            return None, None
        try:
            manifest = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None, "manifest.json missing"
        except (OSError, ValueError) as exc:
            return None, f"manifest.json unreadable: {exc}"
        if not isinstance(manifest, dict) or manifest.get("key") != key:
            return None, "manifest.json names another key"
        if manifest.get("format") != CACHE_FORMAT_VERSION:
            return None, f"cache format {manifest.get('format')} (expected {CACHE_FORMAT_VERSION})"
        cubin = d / CUBIN
        try:
            digest = _sha256_file(cubin)
        except OSError as exc:
            return None, f"kernel.cubin unreadable: {exc.strerror or exc}"
        if digest != manifest.get("cubin_sha256"):
            return None, f"kernel.cubin sha256 {digest[:16]} does not match the manifest's {str(manifest.get('cubin_sha256'))[:16]}"
        for path, what in ((base, "cache layer" if base != self.root else "cache root"), (d.parent, "cache shard"),
                           (d, "cache entry")):
            self._check_safe(path, what)
        return Entry(key=key, dir=d, layer=base, manifest=manifest), None

    def lookup(self, key: str) -> Entry | None:
        """The first valid entry for ``key`` in the root, then the layers. Bad entries are reported and skipped."""
        for base in self.search_path():
            self._check_safe(base, "cache root" if base == self.root else "cache layer")
            entry, problem = self.read_entry(base, key)
            if entry is not None:
                return entry
            if problem is not None:
                bad = BadEntry(self.entry_dir(base, key), problem)
                self.bad_entries.append(bad)
                warnings.warn(f"attnjit: ignoring bad cache entry {bad.dir}: {problem} (it will be rebuilt)",
                              BadEntryWarning, stacklevel=3)
        return None

    def iter_entries(self, bases: Iterable[Path] | None = None) -> Iterable[tuple[Path, str, Entry | None, str | None]]:
        """(base, key, entry, problem) for every entry directory under the given bases (default: all)."""
        for base in (bases if bases is not None else self.search_path()):
            if not base.is_dir():
                continue
            for shard in sorted(base.iterdir()):
                if not (shard.is_dir() and re.fullmatch(r"[0-9a-f]{2}", shard.name)):
                    continue
                for d in sorted(shard.iterdir()):
                    if _KEY_RE.match(d.name) and d.name.startswith(shard.name):
                        entry, problem = self.read_entry(base, d.name)
                        yield base, d.name, entry, problem

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
        shard = self.root / job.key[:2]
        shard.mkdir(mode=0o700, exist_ok=True)
        dest = shard / job.key
        if dest.exists():  # a bad entry (we hold the key's lock, and lookup rejected it)
            os.replace(dest, self.root / ".trash" / f"{job.key}-{uuid.uuid4().hex[:8]}")
        os.replace(d, dest)
        _fsync(shard)
        return Entry(key=job.key, dir=dest, layer=self.root, manifest=manifest)

    # --- maintenance ----------------------------------------------------------------------------------------

    def verify(self) -> list[tuple[Path, str]]:
        """(entry dir, problem) for every bad entry in the root and the layers."""
        return [(self.entry_dir(base, key), problem) for base, key, entry, problem in self.iter_entries()
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
            d = self.entry_dir(base, key)
            os.replace(d, self.root / ".trash" / f"{key}-{uuid.uuid4().hex[:8]}")
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
            d = self.entry_dir(base, key)
            size = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
            try:  # last use = the cubin's mtime, which touch() sets on every load (reading it for the
                used = (d / CUBIN).stat().st_mtime  # sha256 check moves only the atime)
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
            (self.root / ".trash").mkdir(mode=0o700, exist_ok=True)
            os.replace(d, self.root / ".trash" / f"{key}-{uuid.uuid4().hex[:8]}")
            total -= size
            removed += 1
        shutil.rmtree(self.root / ".trash", ignore_errors=True)
        return removed, total

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for base in self.search_path():
            count = size = 0
            for b, key, entry, _problem in self.iter_entries([base]):
                d = self.entry_dir(b, key)
                count += 1
                size += sum(p.stat().st_size for p in d.iterdir() if p.is_file())
            out[str(base)] = {"entries": count, "bytes": size, "exists": base.is_dir()}
        return out


def touch(entry: Entry) -> None:
    """Record a use (for prune's LRU order); silently skipped where the entry is read-only."""
    try:
        os.utime(entry.cubin)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
