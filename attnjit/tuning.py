"""Tuning records: which of a kernel family's named tile configurations (``AttentionSpec.tile``) runs a spec fastest
on a kind of GPU, as ``attnjit tune`` measured it. plan() reads them; the dispatch record then names the tile.

A record is one JSON file ``<root>/tuning/<key>.json``, searched in the cache root and then in every read-only layer
(a fleet ships its records beside its kernels), with key = sha256(record format, the spec without its tile in
canonical form, the GPU: arch and SM count). Content-addressed like the cache: a record can only ever be found for
the spec and GPU it was measured on. Records are read with the cache's trust rules (owned by you or root, writable by
nobody else, a bounded regular file, no symlink) and written atomically (a temp file, then ``os.replace``).

Tuning changes which kernel runs, never what it computes: every configuration computes the same attention, so a
missing, bad or stale record is simply not used (one warning line for a bad one).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import trust
from .cache import Cache
from .specs import AttentionSpec

RECORD_FORMAT = 1
MAX_RECORD_BYTES = 1 << 16
DIR = "tuning"


class BadTuningRecordWarning(UserWarning):
    """A tuning record that cannot be trusted or read was ignored."""


def gpu_id(arch: str, num_sms: int) -> str:
    """What a record is measured on: the arch and the SM count (an H200 and an H100 SXM share records)."""
    return f"{arch}/{num_sms}sm"


def untuned(spec: AttentionSpec) -> AttentionSpec:
    return spec if spec.tile is None else spec.replace(tile=None)


def record_key(spec: AttentionSpec, gpu: str) -> str:
    h = hashlib.sha256()
    for part in (f"attnjit-tuning-{RECORD_FORMAT}", untuned(spec).canonical(), gpu):
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class Record:
    spec: str                      # canonical spec, without a tile
    gpu: str                       # gpu_id()
    tile: str                      # the winner (a name of families.tunable_names(spec))
    ms: dict[str, float]           # every configuration's time on the workload
    workload: str                  # what was timed, e.g. "prefill 8x2048 H_q 32 H_kv 8"
    device: str = ""               # the GPU's name, for people
    created: float = field(default_factory=time.time)
    format: int = RECORD_FORMAT


class TuningStore:
    """The records of one cache: written to its root, found in its root and then its layers."""

    def __init__(self, cache: Cache | None = None):
        self.cache = cache or Cache()

    def path(self, spec: AttentionSpec, gpu: str) -> Path:
        return self.cache.root / DIR / f"{record_key(spec, gpu)}.json"

    def lookup(self, spec: AttentionSpec, gpu: str) -> Record | None:
        name = f"{record_key(spec, gpu)}.json"
        for base in self.cache.search_path():
            try:
                trust.check_tree_top(base, "cache root" if base == self.cache.root else "cache layer")
                with trust.open_dir(base, str(base), follow=True) as base_fd, \
                        trust.open_dir(DIR, f"{base / DIR}", dir_fd=base_fd) as fd:
                    data = trust.read_file(fd, name, f"tuning record {base / DIR / name}", MAX_RECORD_BYTES)
            except FileNotFoundError:
                continue
            except (trust.Untrusted, OSError) as exc:
                warnings.warn(f"attnjit: ignoring tuning record {base / DIR / name}: {exc}", BadTuningRecordWarning,
                              stacklevel=2)
                continue
            record = _parse(data, spec, gpu)
            if isinstance(record, str):
                warnings.warn(f"attnjit: ignoring tuning record {base / DIR / name}: {record}", BadTuningRecordWarning,
                              stacklevel=2)
                continue
            return record
        return None

    def write(self, record: Record) -> Path:
        spec = AttentionSpec.parse(record.spec)
        self.cache._ensure_root()       # the root created private, a read-only one refused
        self.cache._work_dir(DIR)       # created private; a symlink there is refused, never written through
        dest = self.path(spec, record.gpu)
        trust.replace_file(dest, json.dumps(asdict(record), indent=1, sort_keys=True), 0o600, fsync=True)
        _memo.clear()
        return dest


def _parse(data: bytes, spec: AttentionSpec, gpu: str) -> Record | str:
    """The record, or why it is not one plan() may use."""
    try:
        raw: Any = json.loads(data.decode("utf-8"))
        record = Record(**raw)
    except (ValueError, TypeError, UnicodeDecodeError):
        return "not a record of this spec and GPU"
    except RecursionError:  # "[[[[..." under the size limit: json recurses once per level
        return "nested too deeply"
    if record.format != RECORD_FORMAT or record.gpu != gpu or record.spec != untuned(spec).canonical():
        return "not a record of this spec and GPU"
    from . import families

    if record.tile not in families.tunable_names(untuned(spec)):
        return f"tile {record.tile!r} is not a configuration attnjit tune measures for this spec"
    return record


_memo: dict[tuple[AttentionSpec, str, Path], str | None] = {}
_memo_lock = threading.Lock()


def best_tile(spec: AttentionSpec, gpu: str, cache: Cache | None = None) -> str | None:
    """The tuned tile of ``spec`` on ``gpu``, or None (memoized per process: plan() asks every step)."""
    cache = cache or Cache()
    key = (untuned(spec), gpu, cache.root)
    if key in _memo:
        return _memo[key]
    record = TuningStore(cache).lookup(spec, gpu)
    with _memo_lock:
        _memo[key] = record.tile if record is not None else None
    return _memo[key]


def clear_memo() -> None:
    _memo.clear()
