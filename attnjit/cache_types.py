"""The cache's records: what to build (``Job``) and its key, what a lookup finds (``Entry``), what a build
returns (``BuildResult``, ``BuildInterrupted``) and what verification refused (``BadEntry``). Plain data, read by
``attnjit.cache`` (which re-exports every name) and by the tools that list, prune and pack entries."""

from __future__ import annotations

import hashlib
import stat
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

from .build import CUBIN
from .errors import CompileError
from .toolchain import Nvcc

CACHE_FORMAT_VERSION = 2   # 2: the nvcc version left the key and went into the manifest's "toolchain"


class BadEntryWarning(UserWarning):
    """A cache entry failed verification and was ignored (it is rebuilt on the next build)."""


def compute_key(*, source: str, flags: Sequence[str], arch: str) -> str:
    """Everything that names the binary, and nothing that needs a toolchain to compute (see the policy above)."""
    h = hashlib.sha256()
    for part in (f"attnjit-cache-format-{CACHE_FORMAT_VERSION}", arch, "\x00".join(flags), source):
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class Job:
    """One thing to build: its source and everything in its key. ``context`` travels into errors untouched."""

    source: str
    flags: tuple[str, ...]
    arch: str
    label: str                      # readable name for progress lines and errors
    meta: dict[str, Any]            # stored in the manifest (e.g. the canonical spec)
    context: Any = field(default=None, compare=False)
    nvcc: Nvcc | None = field(default=None, compare=False)  # None: the local nvcc, found only if a build is needed

    @cached_property
    def key(self) -> str:  # a rendered source is ~85 KB: hashed once per job, not per use
        return compute_key(source=self.source, flags=self.flags, arch=self.arch)


def toolchain_id(manifest: dict[str, Any]) -> str:
    """The short name of the toolchain that built an entry, e.g. ``nvcc 13.0 V13.0.88``."""
    tc = manifest.get("toolchain")
    return str(tc.get("id", "?")) if isinstance(tc, dict) else "?"


def dir_bytes(d: Path) -> int:
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
        return dir_bytes(self.dir)

    @property
    def toolchain(self) -> str:
        return toolchain_id(self.manifest)


@dataclass
class BuildResult:
    job: Job
    status: str                     # built | cached | failed | interrupted (not built: the build was stopped)
    entry: Entry | None = None
    seconds: float | None = None    # compile seconds (built)
    error: CompileError | None = None


class BuildInterrupted(KeyboardInterrupt):
    """A build stopped by SIGINT (or SIGTERM, turned into this by the CLI). ``.results``: one per job, in order;
    kernels that finished before the signal are published and ``built``, the rest ``interrupted``."""

    def __init__(self, results: list[BuildResult]):
        super().__init__("build interrupted")
        self.results = results


@dataclass(frozen=True)
class BadEntry:
    dir: Path
    problem: str
