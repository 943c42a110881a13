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
        self.path, self.table, self.field = str(path), table, field
        where = str(path)
        if table is not None:
            where += f": [[spec]] table #{table + 1}"
        if field is not None:
            where += f": field {field!r}"
        super().__init__(f"{where}: {message}")


class NvccNotFoundError(AttnjitError):
    def __init__(self, tried: list[str]):
        self.tried = tried
        super().__init__(
            "nvcc not found; looked at " + "; ".join(tried) +
            ". Set ATTNJIT_NVCC to the nvcc binary, or CUDA_HOME to the toolkit root, or put nvcc on PATH.")


class CompileError(AttnjitError):
    """nvcc failed. ``.spec``, ``.first_error`` (the first ``error:`` line) and ``.log_path`` (the full log)."""

    def __init__(self, spec: "AttentionSpec | None", name: str, first_error: str, log_path: Path, log: str):
        self.spec, self.name, self.first_error, self.log_path, self.log = spec, name, first_error, log_path, log
        tail = "\n".join(log.strip().splitlines()[-40:])
        super().__init__(
            f"nvcc failed for {name}: {first_error}\n  full log: {log_path}\n"
            + (f"  spec: {spec.canonical()}\n" if spec is not None else "")
            + f"--- log (last lines) ---\n{tail}")


class CacheMissError(AttnjitError):
    """Strict mode (ATTNJIT_JIT=0) and the kernel is not in any cache layer."""

    def __init__(self, spec: "AttentionSpec", key: str, searched: list[Path], command: str):
        self.spec, self.key, self.searched, self.command = spec, key, searched, command
        super().__init__(
            f"kernel not in the cache and ATTNJIT_JIT=0 forbids compiling: {spec.canonical()} (key {key[:16]}); "
            f"searched {', '.join(str(p) for p in searched) or 'nothing'}. Pre-warm it with: {command}")


class CacheError(AttnjitError):
    """The cache cannot be used as asked (read-only root, unsafe permissions, lock timeout)."""


class CacheReadOnlyError(CacheError):
    pass


class UnsafeCacheError(CacheError):
    pass


class LockTimeoutError(CacheError):
    def __init__(self, lock_path: Path, timeout: float):
        self.lock_path, self.timeout = lock_path, timeout
        super().__init__(
            f"waited {timeout:.0f} s for the build lock {lock_path} (another process is building the same kernel); "
            "if no attnjit process is running, the lock is free and this is a slow build: raise ATTNJIT_LOCK_TIMEOUT")


class NoGPUError(AttnjitError):
    """A kernel was asked to run where there is no CUDA device."""
