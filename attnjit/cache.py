"""Content-addressed store of compiled kernels.

Key = sha256(cache format version, target arch, nvcc flags, rendered source). An entry is
``<root>/<key[:2]>/<key>/`` holding ``kernel.cubin``, ``kernel.cu``, ``build.log`` and ``manifest.json``.

Toolchain policy: the nvcc version is *not* in the key. Finding, verifying and loading an entry never runs or needs
nvcc, so a serving host with only the driver serves every warmed kernel. Any verified entry for the same source,
flags and arch serves a lookup, whichever nvcc built it; the manifest records that toolchain (``toolchain``: path,
``nvcc --version`` text, release and build id), ``attnjit cache list`` and the dispatch record show it, and
``attnjit cache prune --built-by ID`` removes the entries of one toolchain (to rebuild them with another). A build
uses, and records, the local nvcc.

Contracts:
  * Publication is atomic: an entry is built in ``<root>/.tmp/``, its manifest written last, and the directory
    moved into place with one ``os.replace``. A reader sees a whole entry or none; a process killed mid-build
    leaves only a temp directory that the next build removes.
  * One ``filelock`` per key (``<root>/.locks/<key>.lock``): concurrent processes build each key once. The OS
    releases a dead process's lock. Lookups take no lock. A build holds the locks of at most ``BATCH`` keys at a
    time (a warm of 10,000 specs must not run out of file descriptors).
  * Each kernel is published the moment nvcc finishes it (``build.run_ninja``), so an interrupted warm keeps what
    finished: ``build`` then raises ``BuildInterrupted`` (a KeyboardInterrupt) carrying every result so far.
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
import sys
import uuid
import warnings
from contextlib import ExitStack
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from filelock import FileLock, Timeout

from . import cache_tag, knobs
from .build import (CUBIN, SOURCE, STARTED, BuildEvent, Outcome, Target, first_error_line,  # noqa: F401 (SOURCE)
                    quiet_signals, restore_signals, run_ninja)
from .errors import BuildSetupError, CacheError, CacheReadOnlyError, CompileError, LockTimeoutError, UnsafeCacheError
from .cache_types import (CACHE_FORMAT_VERSION, BadEntry, BadEntryWarning, BuildInterrupted,  # noqa: F401
                          BuildResult, Entry, Job, compute_key, dir_bytes, toolchain_id)
from .toolchain import nvcc
from .trust import (MAX_CUBIN_BYTES, MAX_MANIFEST_BYTES, Untrusted, check_tree_top, open_dir, ownership_problem,
                    private_dir, read_file)

MANIFEST = "manifest.json"  # beside build.py's CUBIN and SOURCE
BATCH = 256                # keys whose locks one ninja run holds
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
_FIELD_TYPES = {"label": "", "created": "", "compile_seconds": 0.0, "toolchain": {}, "key_inputs": {}, "meta": {}}
_JSON_KINDS = ((type(None), "null"), (bool, "a boolean"), (str, "a string"), ((int, float), "a number"),
               (list, "an array"), (dict, "an object"))


def _json_kind(value: Any) -> str:
    return next(name for t, name in _JSON_KINDS if isinstance(value, t))


def _printable_fields(manifest: dict) -> str | None:
    """Why the fields cache list prints are unfit to print (a number that is not a finite, sane duration; control
    characters in a string, which would forge rows or escape codes), or None."""
    secs = manifest.get("compile_seconds", 0.0)
    try:
        sane = 0.0 <= float(secs) <= 1e7
    except OverflowError:
        sane = False
    if not sane:
        return "manifest.json compile_seconds is not a duration of 0 to 1e7 seconds"
    for name in ("label", "created"):
        if any(map(_control, manifest.get(name, ""))):
            return f"manifest.json {name} holds control characters"
    if any(map(_control, toolchain_id(manifest))):
        return "manifest.json toolchain id holds control characters"
    return None


def _control(c: str) -> bool:
    """A control character (C0, DEL, C1): what a printed manifest field may not hold."""
    return ord(c) < 32 or 127 <= ord(c) < 160


def printable(text: str) -> str:
    """``text`` with its control characters as ``?``: what the cache writes into the fields it prints, and how the
    CLI prints text that comes from the disk (a bad entry's problem, a directory name)."""
    return "".join("?" if _control(c) else c for c in text)


def default_root() -> Path:
    return knobs.CACHE_DIR.get() or Path.home() / ".cache" / "attnjit"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Cache:
    """A writable root plus read-only layers searched after it: ``ATTNJIT_CACHE_PATH``, then the layers of installed
    kernel packages (``pack``), unless ``layers`` names them."""

    def __init__(self, root: Path | str | None = None, layers: Sequence[Path | str] | None = None):
        self.root = Path(root).expanduser() if root is not None else default_root()
        if layers is None:  # the environment's: ATTNJIT_CACHE_PATH, then installed kernel packages
            from .pack import installed_layers

            layers = [*knobs.CACHE_PATH.get(), *installed_layers()]
        # a layer that is the root itself (ATTNJIT_CACHE_PATH naming it) would list and look up every entry twice
        root_real = os.path.realpath(self.root)
        self.layers = tuple(p for p in dict.fromkeys(Path(p).expanduser() for p in layers)
                            if os.path.realpath(p) != root_real)
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
        cache_tag.claim(self.root)   # a directory of the user's is refused before anything in it is touched
        for sub in (".tmp", ".locks", ".trash", "failed"):
            self._work_dir(sub)

    def _work_dir(self, name: str) -> Path:
        try:
            return private_dir(self.root / name, "cache work directory")
        except Untrusted as exc:
            raise UnsafeCacheError(f"{exc}; attnjit removes what it holds, so it must be the root's own: "
                                   "remove it") from None

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
        except RecursionError:  # "[[[[..." under the size limit: json recurses once per level
            return None, "manifest.json unreadable: nested too deeply"
        except PermissionError as exc:
            return None, f"manifest.json unreadable: {exc.strerror}"
        if not isinstance(manifest, dict) or manifest.get("key") != key:
            return None, "manifest.json names another key"
        if manifest.get("format") != CACHE_FORMAT_VERSION:
            return None, (f"cache format {manifest.get('format')} (expected {CACHE_FORMAT_VERSION}: another attnjit "
                          "version wrote it; attnjit cache prune removes bad entries first)")
        for name, like in _FIELD_TYPES.items():  # what cache list, pack and the dispatch record read
            if name in manifest and _json_kind(manifest[name]) != _json_kind(like):
                return None, f"manifest.json {name} is {_json_kind(manifest[name])}, expected {_json_kind(like)}"
        problem = _printable_fields(manifest)
        if problem:
            return None, problem
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
                    warnings.warn(printable(f"attnjit: ignoring {kind} cache entry {bad.dir}: "
                                            f"{problem.removeprefix('untrusted: ')} ({fix})"),
                                  BadEntryWarning, stacklevel=3)
        return None

    @staticmethod
    def row_dir(base: Path, key: str) -> Path:
        """The directory an ``iter_entries`` row names (an entry, or a shard that could not be listed)."""
        return base / key if len(key) == 2 else base / key[:2] / key

    def iter_entries(self, bases: Iterable[Path] | None = None) -> Iterable[tuple[Path, str, Entry | None, str | None]]:
        """(base, key, entry, problem) for every entry directory under the given bases (default: all).

        A shard directory that cannot be listed, or is a symlink, is one row whose key is the shard's two-hex-digit
        name."""
        for base, name, problem in self._rows(bases):
            if problem is None:
                yield base, name, *self.read_entry(base, name)
            else:
                yield base, name, None, problem

    def _rows(self, bases: Iterable[Path] | None) -> Iterable[tuple[Path, str, str | None]]:
        """(base, key, None) for every entry directory, unverified, and (base, shard, problem) for an unreadable or
        symlinked shard; each base checked as trusted first."""
        for base in (bases if bases is not None else self.search_path()):
            self._check_safe(base, self._what(base))
            if not base.is_dir():
                continue
            for shard in sorted(base.iterdir()):
                if not re.fullmatch(r"[0-9a-f]{2}", shard.name):
                    continue
                if shard.is_symlink():  # one row for the link itself: clear and prune must never act through it
                    yield base, shard.name, f"untrusted: shard directory {shard} is a symlink, not a directory"
                    continue
                if not shard.is_dir():
                    continue
                try:
                    names = sorted(p.name for p in shard.iterdir())
                except OSError as exc:
                    yield base, shard.name, f"shard directory unreadable: {exc.strerror or exc}"
                    continue
                for name in names:
                    if _KEY_RE.match(name) and name.startswith(shard.name):
                        yield base, name, None

    # --- building -----------------------------------------------------------------------------------------

    def _lock(self, key: str) -> FileLock:
        return FileLock(str(self.root / ".locks" / f"{key}.lock"))

    @staticmethod
    def _acquire(lock: FileLock, timeout: float = -1) -> None:
        """``lock.acquire``, with a lock file that cannot be opened named (a symlink planted in the root's lock
        folder, which filelock refuses to follow, or a full disk) instead of a bare OSError. Timeout passes."""
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise
        except OSError as exc:
            path = Path(lock.lock_file)
            if exc.errno == errno.ELOOP:
                raise UnsafeCacheError(f"lock file {path} is a symlink, which attnjit never follows; remove it "
                                       "(only a process of this user could have put it there)") from None
            raise CacheError(f"cannot open the lock file {path}: {exc.strerror or exc}") from None

    def _clean_stale_builds(self) -> None:
        """Remove temp build directories whose builder is gone (its lock is free)."""
        tmp = self.root / ".tmp"
        for d in tmp.glob("build-*"):
            if not d.is_dir():
                continue
            lock = FileLock(str(d) + ".lock")
            try:
                self._acquire(lock, 0)
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
              progress: Callable[[BuildEvent], None] | None = None) -> list[BuildResult]:
        """Make sure every job has a valid entry: reuse what exists, build the rest (in parallel, via ninja).

        Returns one result per job, in order. Failures are results (status ``failed`` with ``error``), not
        exceptions, so one bad spec does not stop a pre-warm of many. The local nvcc is looked up only when
        something must be built (``NvccNotFoundError`` then). SIGINT raises ``BuildInterrupted`` with the results
        so far, after stopping every compiler and publishing what finished.
        """
        say = progress or (lambda _event: None)
        jobs_n = parallel if parallel is not None else (knobs.JOBS.get() or os.cpu_count() or 1)
        if jobs_n < 1:
            raise ValueError(f"parallel nvcc jobs must be >= 1, got {jobs_n}")
        by_key: dict[str, BuildResult] = {}
        order = [job.key for job in jobs]
        try:
            for job, key in zip(jobs, order):
                if key not in by_key:
                    entry = self.lookup(key)
                    by_key[key] = BuildResult(job, "cached", entry) if entry else BuildResult(job, "pending")
            pending = [r.job for r in by_key.values() if r.status == "pending"]
            say(BuildEvent("plan", total=len(by_key), cached=len(by_key) - len(pending)))
            if pending:
                local = None if all(j.nvcc for j in pending) else nvcc()  # NvccNotFoundError: nothing can build
                pending = [j if j.nvcc else replace(j, nvcc=local) for j in pending]
                self._ensure_root()
                self._clean_stale_builds()
                self._build_pending(pending, by_key, jobs_n, say)
        except KeyboardInterrupt:
            saved = quiet_signals()
            try:
                for job, key in zip(jobs, order):
                    r = by_key.get(key)
                    if r is None or r.status == "pending":  # published just before the signal cut its bookkeeping?
                        entry = self.lookup(key)
                        by_key[key] = BuildResult(job, "built", entry) if entry else BuildResult(job, "interrupted")
            finally:
                restore_signals(saved)
            raise BuildInterrupted([by_key[k] for k in order]) from None
        return [by_key[k] for k in order]

    def _build_pending(self, pending: list[Job], by_key: dict[str, BuildResult], parallel: int,
                       say: Callable[[BuildEvent], None]) -> None:
        timeout = knobs.LOCK_TIMEOUT.get()
        waiting: list[Job] = []   # locked by another process: wait once ours are built
        while pending or waiting:
            if not pending:
                for job in waiting:
                    say(BuildEvent("waiting", job.label, job.key))
                    lock = self._lock(job.key)
                    try:
                        self._acquire(lock, timeout)
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
                waiting = []
                continue
            mine: list[tuple[Job, FileLock]] = []
            try:
                while pending and len(mine) < BATCH:
                    job = pending.pop(0)
                    lock = self._lock(job.key)
                    try:
                        self._acquire(lock, 0)
                    except Timeout:
                        waiting.append(job)
                        continue
                    entry = self.lookup(job.key)  # built by someone else since we looked
                    if entry is not None:
                        lock.release()
                        by_key[job.key] = BuildResult(job, "cached", entry)
                    else:
                        mine.append((job, lock))
                if mine:
                    self._build_locked([j for j, _ in mine], by_key, parallel, say)
            finally:
                for _, lock in mine:
                    lock.release()

    def _build_locked(self, jobs: list[Job], by_key: dict[str, BuildResult], parallel: int,
                      say: Callable[[BuildEvent], None]) -> None:
        """Build jobs whose key locks we hold, through one ninja run, publishing each success as it finishes."""
        # Take the temp dir's lock before the dir exists: another process's _clean_stale_builds removes any
        # build-* dir whose lock is free, so a dir created before its lock could vanish under us.
        bdir = self.root / ".tmp" / f"build-{uuid.uuid4().hex[:16]}"
        blk = FileLock(str(bdir) + ".lock")
        self._acquire(blk)
        try:
            try:
                bdir.mkdir(mode=0o700)
            except OSError as exc:
                raise BuildSetupError(bdir, exc.strerror or str(exc)) from None
            by_target = {j.key: j for j in jobs}
            # build() gave each job an nvcc
            targets = [Target(j.key, j.source, j.nvcc.path, j.flags, j.label) for j in jobs]

            def finished(out: Outcome) -> None:
                job = by_target[out.key]
                d = bdir / job.key
                if out.ok:
                    entry = self._publish(job, d, out.seconds)
                    by_key[job.key] = BuildResult(job, "built", entry, out.seconds)
                    say(BuildEvent("built", job.label, job.key, seconds=out.seconds))
                    return
                failed = self.root / "failed" / job.key
                shutil.rmtree(failed, ignore_errors=True)
                os.replace(d, failed)
                error = CompileError(job.context, job.label, first_error_line(out.log), failed / out.log_name,
                                     out.log)
                by_key[job.key] = BuildResult(job, "failed", None, out.seconds, error)
                say(BuildEvent("failed", job.label, job.key, seconds=out.seconds, error=error))

            say(BuildEvent("start", total=len(targets), parallel=parallel))
            run_ninja(bdir, targets, parallel, on_finished=finished,
                      on_compiling=lambda labels: say(BuildEvent("compiling", compiling=tuple(labels))))
        finally:
            shutil.rmtree(bdir, ignore_errors=True)
            blk.release()
            Path(str(bdir) + ".lock").unlink(missing_ok=True)

    def _publish(self, job: Job, d: Path, seconds: float) -> Entry:
        assert job.nvcc is not None
        cubin = d / CUBIN
        image = cubin.read_bytes()  # our own private file, just written
        tool = job.nvcc
        manifest = {
            "format": CACHE_FORMAT_VERSION,
            "key": job.key,
            "label": printable(job.label),  # printable, as the reader asks
            "meta": job.meta,
            "key_inputs": {"arch": job.arch, "flags": list(job.flags),
                           "source_sha256": hashlib.sha256(job.source.encode("utf-8")).hexdigest()},
            "toolchain": {"id": tool.ident, "release": tool.release, "version": tool.version,
                          "nvcc": str(tool.path)},
            "cubin_sha256": hashlib.sha256(image).hexdigest(),
            "cubin_bytes": len(image),
            "compile_seconds": round(min(max(seconds, 0.0), 1e7), 3),   # a clock step mid-build: still readable
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": sys.version.split()[0],
        }
        (d / STARTED).unlink(missing_ok=True)  # the marker was for progress only
        _fsync(cubin)
        tmp_manifest = d / (MANIFEST + ".part")
        tmp_manifest.write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
        _fsync(tmp_manifest)
        os.replace(tmp_manifest, d / MANIFEST)   # the manifest is the commit marker, written last
        for p in d.iterdir():
            os.chmod(p, 0o600)
        os.chmod(d, 0o700)
        shard = self.root / job.key[:2]
        try:
            st = shard.lstat()
            if not stat.S_ISDIR(st.st_mode) or ownership_problem(st, "shard"):
                self.discard(shard)  # a link, a file or a foreign directory: never publish through it
        except FileNotFoundError:
            pass
        shard.mkdir(mode=0o700, exist_ok=True)
        dest = shard / job.key
        if os.path.lexists(dest):  # a bad entry (we hold the key's lock, and lookup rejected it)
            self.discard(dest)
        os.replace(d, dest)
        _fsync(shard)
        return Entry(key=job.key, dir=dest, layer=self.root, manifest=manifest, image=image)

    def discard(self, path: Path) -> None:
        """Move a root entry (or a bad shard) into .trash, where it is removed; works on unreadable entries too."""
        if path.is_dir() and not path.is_symlink():
            try:  # moving a directory updates its "..": it must be writable
                os.chmod(path, 0o700)
            except OSError:
                pass
        trash = self._work_dir(".trash")
        os.replace(path, trash / f"{path.name}-{uuid.uuid4().hex[:8]}")

    # --- maintenance (policy in ``maintenance``) ---------------------------------------------------------

    def verify(self) -> list[tuple[Path, str]]:
        """(entry dir, problem) for every bad entry in the root and the layers."""
        return [(self.row_dir(base, key), problem) for base, key, entry, problem in self.iter_entries()
                if entry is None]

    def clear(self, *, dry_run: bool = False) -> int:
        """Remove every entry of the root (never the layers). Returns how many (would be) removed."""
        from .maintenance import clear

        return len(clear(self, dry_run=dry_run))

    def prune(self, max_bytes: int | None = None, *, built_by: str | None = None,
              dry_run: bool = False) -> tuple[int, int]:
        """Remove root entries: those built by toolchain ``built_by``, then least recently used ones until the rest
        total at most ``max_bytes``. Returns (entries removed, bytes remaining)."""
        from .maintenance import prune

        removed, remaining = prune(self, max_bytes, built_by=built_by, dry_run=dry_run)
        return len(removed), remaining

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for base in self.search_path():
            count = size = 0
            for b, key, _problem in self._rows([base]):  # counting needs no verification (verify does that)
                count += 1
                size += dir_bytes(self.row_dir(b, key))
            out[str(base)] = {"entries": count, "bytes": size, "exists": base.is_dir()}
        return out


def touch(entry: Entry) -> None:
    """Record a use (for prune's LRU order); silently skipped where the entry is read-only."""
    try:
        os.utime(entry.cubin, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
