"""Housekeeping of a cache root: clear it, prune it by size (least recently used first) or by the toolchain that
built its entries. Never touches a read-only layer. Every operation can be a dry run that only lists.

The last use of an entry is its cubin's mtime, which ``cache.touch`` sets on every load (reading the file for
the sha256 check moves only the atime).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import cache_tag
from .cache import CUBIN, Cache, dir_bytes, toolchain_id
from .errors import CacheError, CacheReadOnlyError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``500M`` -> 524288000. Units are binary (K = 1024, M = 1024**2, ...); a plain number is bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: expected a number of bytes with an optional unit K, M, G or T "
                         "(binary: 500M = 500 MiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def toolchain_matches(manifest: dict, text: str) -> bool:
    """``--built-by`` matches the toolchain id (``nvcc 13.0 V13.0.88``), its build (``V13.0.88`` or ``13.0.88``)
    or its release (``13.0``)."""
    ident = toolchain_id(manifest)
    parts = ident.split()
    want = text.strip()
    if want == ident:
        return True
    if len(parts) == 3:
        _, release, build = parts
        return want in (release, build, build.removeprefix("V"))
    return False


@dataclass(frozen=True, eq=False)
class Item:
    dir: Path
    used: float
    size: int
    manifest: dict | None   # None for a bad entry


def _root_exists(cache: Cache) -> bool:
    """Whether the root is there to clean; a root that is something other than a directory is an error, not an
    empty cache (a clear that "removed 0" from a file would hide a wrong path)."""
    root = cache.root
    if root.is_symlink() and not root.exists():
        raise CacheError(f"cache root {root} is a dangling symlink")
    if not root.exists():
        return False
    if not root.is_dir():
        raise CacheError(f"cache root {root} is not a directory")
    return True


def _items(cache: Cache) -> list[Item]:
    items = []
    for base, key, entry, _problem in cache.iter_entries([cache.root]):
        d = cache.row_dir(base, key)
        try:
            used = (d / CUBIN).lstat().st_mtime
        except OSError:
            used = 0.0
        items.append(Item(d, used, dir_bytes(d), entry.manifest if entry else None))
    return items


def _check_removable(cache: Cache) -> None:
    """Before anything is removed: the root is writable and attnjit's own (a directory of the user's is refused)."""
    if not cache.root_writable():
        raise CacheReadOnlyError(f"cache root {cache.root} is read-only; nothing was removed")
    cache_tag.claim(cache.root, write=False)


def _remove(cache: Cache, doomed: list[Item]) -> None:
    """The doomed entries removed (the root checked by _check_removable)."""
    for item in doomed:
        cache.discard(item.dir)
    shutil.rmtree(cache.root / ".trash", ignore_errors=True)


def clear(cache: Cache, *, dry_run: bool = False) -> list[Item]:
    """Every entry of the root, removed (unless ``dry_run``), and the failed-build logs with them."""
    if not _root_exists(cache):
        return []
    items = _items(cache)
    if not dry_run:
        _check_removable(cache)
        if items:
            _remove(cache, items)
        shutil.rmtree(cache.root / "failed", ignore_errors=True)
    return items


def prune(cache: Cache, max_bytes: int | None = None, *, built_by: str | None = None,
          keep: frozenset[str] | None = None, dry_run: bool = False) -> tuple[list[Item], int]:
    """(entries removed, bytes remaining). Entries built by ``built_by`` go, and with ``keep`` (cache keys: what
    catalogs build now) every entry whose key is not in it, bad ones included; then, for ``max_bytes``, bad entries
    first and then the least recently used, until the rest fit."""
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if max_bytes is None and built_by is None and keep is None:
        raise ValueError("prune needs max_bytes, built_by or keep")
    items = _items(cache) if _root_exists(cache) else []
    doomed, rest = [], []
    for i in items:
        by = built_by is not None and i.manifest is not None and toolchain_matches(i.manifest, built_by)
        stale = keep is not None and len(i.dir.name) > 2 and i.dir.name not in keep  # (2: a shard not listed)
        (doomed if by or stale else rest).append(i)
    rest.sort(key=lambda i: (i.manifest is not None, i.used))  # bad, then oldest
    total = sum(i.size for i in rest)
    if max_bytes is not None:
        for item in rest:
            if total <= max_bytes:
                break
            doomed.append(item)
            total -= item.size
    if doomed and not dry_run:
        _check_removable(cache)
        _remove(cache, doomed)
    return doomed, total
