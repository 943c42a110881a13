"""Every environment variable attnjit reads, declared once: name, type, default, meaning.

Nothing else in the package calls ``os.environ``; it asks this module, at the moment it needs the
value (so a test or a long-lived process that changes the environment sees the change). plan() asks several knobs
every call, so the lookup is one dict read (``_lookup``), as dispatch's for ATTNJIT_LOG.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Knob(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    meaning: str

    def get(self) -> T:
        raw = _lookup(self.name)
        if raw is None or raw == "":
            return self.default
        return self.value_of(raw)

    def value_of(self, raw: str) -> T:
        """``raw`` (a value of this variable already read) parsed, or a ValueError naming the variable."""
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"environment variable {self.name}={raw!r} is invalid: {exc}") from None

    def is_set(self) -> bool:
        return bool(_lookup(self.name))

    def describe(self) -> dict[str, object]:
        """name, value, source (``env`` or ``default``), raw text, default and meaning; an invalid setting is
        reported in ``error`` instead of raising (``attnjit info`` shows everything it can)."""
        raw = os.environ.get(self.name)
        out: dict[str, object] = {"name": self.name, "source": "env" if raw else "default", "raw": raw or None,
                                  "default": _plain(self.default), "meaning": self.meaning}
        try:
            out["value"] = _plain(self.get())
        except ValueError as exc:
            out["value"], out["error"] = None, str(exc)
        return out


_KEYS: dict[str, bytes] = {}   # knob name -> its key in os.environ's dict of bytes


def _lookup(name: str) -> str | None:
    """os.environ.get(name), read live. On POSIX straight from os.environ's dict of bytes (the one putenv and
    os.environ's setters update), about 20x cheaper than the mapping's own get; any other os.environ (another
    platform, a test's replacement mapping) through its get."""
    env = os.environ
    data = getattr(env, "_data", None)
    if type(data) is not dict or os.name != "posix":
        return env.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = os.fsencode(name)
    raw = data.get(key)
    return None if raw is None else os.fsdecode(raw)


def _plain(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("expected a positive number of seconds")
    return value


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("expected a positive integer")
    return value


def _path(raw: str) -> Path:
    """A path; one of blanks only is refused (a stray space in a shell assignment, not a directory name)."""
    if not raw.strip():
        raise ValueError("expected a path, got only blanks")
    return Path(raw).expanduser()


def _path_list(raw: str) -> tuple[Path, ...]:
    return tuple(_path(p) for p in raw.split(":") if p)


CACHE_DIR: Knob[Path | None] = Knob(
    "ATTNJIT_CACHE_DIR", None, _path,
    "writable cache root (default ~/.cache/attnjit); --cache-dir overrides it")
CACHE_PATH: Knob[tuple[Path, ...]] = Knob(
    "ATTNJIT_CACHE_PATH", (), _path_list,
    "colon-separated read-only cache layers, searched after the root (a warmed image or shared mount)")
NVCC: Knob[Path | None] = Knob(
    "ATTNJIT_NVCC", None, _path,
    "nvcc to build with; else $CUDA_HOME/bin/nvcc, else the nvcc on PATH")
CUDA_HOME: Knob[Path | None] = Knob(
    "CUDA_HOME", None, lambda s: Path(s).expanduser(), "CUDA toolkit root; its bin/nvcc is the second choice")
JIT: Knob[bool] = Knob(
    "ATTNJIT_JIT", True, _bool,
    "1 (default): build a kernel on a cache miss; 0 (strict mode): a miss raises CacheMissError")
LOG: Knob[Path | None] = Knob(
    "ATTNJIT_LOG", None, _path,
    "append one JSON line per kernel dispatch to this file")
LOCK_TIMEOUT: Knob[float] = Knob(
    "ATTNJIT_LOCK_TIMEOUT", 900.0, _positive_float,
    "seconds to wait for another process's build of the same kernel before giving up")
def _arch(raw: str) -> str:
    from .specs import supported_arch  # specs imports nothing of knobs

    if not supported_arch(raw.strip()):
        raise ValueError("expected sm_XY or sm_XYa with XY >= 80, e.g. sm_80, sm_90a")
    return raw.strip()


ARCH: Knob[str | None] = Knob(
    "ATTNJIT_ARCH", None, _arch,
    "arch where there is no GPU (warm on a build machine, CPU planning; default sm_90a); a present GPU's own "
    "arch always wins over it")
ARCH_OVERRIDE: Knob[str | None] = Knob(
    "ATTNJIT_ARCH_OVERRIDE", None, _arch,
    "force this arch everywhere: at run time instead of the GPU's own, and as warm's default")
JOBS: Knob[int | None] = Knob(
    "ATTNJIT_JOBS", None, _positive_int, "parallel nvcc jobs for a build (default: CPU count); --jobs overrides it")
NUM_SMS: Knob[int | None] = Knob(
    "ATTNJIT_NUM_SMS", None, _positive_int,
    "SM count the split-KV scheduler plans for when no GPU is present (default 132, an H100/H200)")

NATIVE: Knob[bool] = Knob(
    "ATTNJIT_NATIVE", True, _bool,
    "1 (default): plan with the compiled scheduler (attnjit._cplan) where it was built and copy plan() metadata "
    "through CuPy's runtime calls; 0: the Python scheduler (same work lists) and torch's copies")

TMA: Knob[bool] = Knob(
    "ATTNJIT_TMA", True, _bool,
    "1 (default): sm90 kernels copy q and the KV cache, and store the output, with the TMA unit where the tensors "
    "allow (attnjit/tma.py); 0: cp.async copies and 16-byte stores only (the same kernels and results)")

WORK_CLAIMS: Knob[bool] = Knob(
    "ATTNJIT_WORK_CLAIMS", True, _bool,
    "1 (default): the CTAs of a persistent (sm90) kernel claim work items from a counter in the plan's metadata "
    "(longest first, so the balance of LPT); 0: each walks the list by grid stride (the same results); read by plan()")

PACKAGES: Knob[bool] = Knob(
    "ATTNJIT_PACKAGES", True, _bool,
    "1 (default): also search the layers of installed kernel packages (attnjit pack wheels); 0: ignore them")

ALL: tuple[Knob, ...] = (CACHE_DIR, CACHE_PATH, PACKAGES, NVCC, CUDA_HOME, JIT, LOG, LOCK_TIMEOUT, ARCH, ARCH_OVERRIDE,
                         JOBS, NUM_SMS, NATIVE, TMA, WORK_CLAIMS)
