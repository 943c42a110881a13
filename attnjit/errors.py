"""Exceptions with structured fields. Each message says what was expected, what was received, and what to do."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .specs import AttentionSpec


class AttnjitError(Exception):
    """Base class of attnjit's own errors (bad input stays ValueError/TypeError)."""


class CatalogError(ValueError):
    """A spec catalog (TOML) is malformed. ``.path``, ``.table`` and ``.field`` say where."""

    def __init__(self, path: str | Path, table: int | None, field: str | None, message: str):
        self.path, self.table, self.field, self.message = str(path), table, field, message
        where = str(path)
        if table is not None:
            where += f": [[spec]] table #{table + 1}"
        if field is not None:
            where += f": field {field!r}"
        super().__init__(f"{where}: {message}")

    def __reduce__(self):
        return CatalogError, (self.path, self.table, self.field, self.message)


class NvccNotFoundError(AttnjitError):
    def __init__(self, tried: list[str]):
        self.tried = tried
        super().__init__(
            "nvcc not found; looked at " + "; ".join(tried) +
            ". Set ATTNJIT_NVCC to the nvcc binary, or CUDA_HOME to the toolkit root, or put nvcc on PATH.")

    def __reduce__(self):
        return NvccNotFoundError, (self.tried,)


class CompileError(AttnjitError):
    """nvcc failed. ``.spec``, ``.first_error`` (the first ``error:`` line) and ``.log_path`` (the full log)."""

    def __init__(self, spec: "AttentionSpec | None", name: str, first_error: str, log_path: Path, log: str):
        self.spec, self.name, self.first_error, self.log_path, self.log = spec, name, first_error, log_path, log
        tail = "\n".join(log.strip().splitlines()[-40:])
        super().__init__(
            f"nvcc failed for {name}: {first_error}\n  full log: {log_path}\n"
            + (f"  spec: {spec.canonical()}\n" if spec is not None else "")
            + f"--- log (last lines) ---\n{tail}")

    def __reduce__(self):
        return CompileError, (self.spec, self.name, self.first_error, self.log_path, self.log)


class CacheMissError(AttnjitError):
    """The kernel is not in any cache layer and cannot be built here: strict mode (``ATTNJIT_JIT=0``) forbids it
    (``reason="strict"``) or there is no nvcc (``reason="no-nvcc"``, ``.nvcc_tried``). ``.bad`` lists the
    (entry dir, problem) of entries that were found for the key and refused. ``.command`` is the ``attnjit warm``
    command that fixes it, or None when the spec cannot be named on a command line (a variant declared in
    ``__main__``); ``.hint`` then says what to do instead."""

    def __init__(self, spec: "AttentionSpec", key: str, searched: list[Path], command: str | None, *,
                 bad: tuple[tuple[Path, str], ...] = (), reason: str = "strict",
                 nvcc_tried: tuple[str, ...] = (), hint: str | None = None):
        self.spec, self.key, self.searched, self.command = spec, key, searched, command
        self.bad, self.reason, self.nvcc_tried, self.hint = tuple(bad), reason, tuple(nvcc_tried), hint
        why = ("ATTNJIT_JIT=0 forbids compiling" if reason == "strict" else
               f"nvcc is missing, so it cannot be built here (looked at {'; '.join(nvcc_tried)})")
        if self.bad:
            what = "kernel in the cache is bad" if len(self.bad) == 1 else "kernel's cache entries are bad"
            found = "; ".join(f"{d}: {problem}" for d, problem in self.bad)
            head = f"{what} ({found}) and {why}"
        else:
            head = f"kernel not in the cache and {why}"
        fix = f"Pre-warm it with: {command}" if command else (hint or "")
        if reason != "strict":
            fix += " (or install the CUDA toolkit: set ATTNJIT_NVCC or CUDA_HOME, or put nvcc on PATH)"
        super().__init__(
            f"{head}: {spec.canonical()} (key {key[:16]}); searched "
            f"{', '.join(str(p) for p in searched) or 'nothing'}. {fix}")

    def __reduce__(self):
        return _rebuild_cache_miss, (self.spec, self.key, self.searched, self.command, self.bad, self.reason,
                                     self.nvcc_tried, self.hint)


def _rebuild_cache_miss(spec, key, searched, command, bad, reason, nvcc_tried, hint) -> CacheMissError:
    return CacheMissError(spec, key, searched, command, bad=bad, reason=reason, nvcc_tried=nvcc_tried, hint=hint)


class CacheError(AttnjitError):
    """The cache cannot be used as asked (read-only root, unsafe permissions, lock timeout)."""


class CacheReadOnlyError(CacheError):
    pass


class UnsafeCacheError(CacheError):
    pass


class BuildSetupError(CacheError):
    """The build directory could not be prepared (a full disk, no inodes, a read-only file system)."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"cannot write the build files in {path}: {reason}; free space or inodes there, or point "
                         "ATTNJIT_CACHE_DIR (or --cache-dir) at another file system")

    def __reduce__(self):
        return BuildSetupError, (self.path, self.reason)


class LockTimeoutError(CacheError):
    def __reduce__(self):
        return LockTimeoutError, (self.lock_path, self.timeout)

    def __init__(self, lock_path: Path, timeout: float):
        self.lock_path, self.timeout = lock_path, timeout
        super().__init__(
            f"waited {timeout:.0f} s for the build lock {lock_path} (another process is building the same kernel); "
            "if no attnjit process is running, the lock is free and this is a slow build: raise ATTNJIT_LOCK_TIMEOUT")


class NoGPUError(AttnjitError):
    """A kernel was asked to run where there is no CUDA device."""
