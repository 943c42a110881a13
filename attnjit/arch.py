"""Which GPU architecture a kernel is built for: at run time, and when pre-warming.

The rules (README and docs/deployment.md state them the same way):
  * Run time: the GPU's own arch (compute capability 9.0 -> ``sm_90a``, else ``sm_XY``), unless
    ``ATTNJIT_ARCH_OVERRIDE`` forces one. ``ATTNJIT_ARCH`` never overrides a GPU that is present.
  * Warm/pack/render: ``--arch`` (one or several, ``sm_80,sm_90a``); else ``ATTNJIT_ARCH_OVERRIDE``; else the arch
    of every local GPU; else ``ATTNJIT_ARCH``; else ``sm_90a``. A catalog table that names ``arch`` keeps it.

Local GPUs are found through the driver (``libcuda``) with ctypes: no torch, no CuPy, no toolkit, and nothing at
all on a machine without a driver.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

from . import knobs
from .specs import DEFAULT_ARCH, supported_arch

_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


def check_arch(arch: str, where: str) -> str:
    if not supported_arch(arch.strip()):
        raise ValueError(f"{where}: {arch!r} is not an arch attnjit builds for; expected sm_XY or sm_XYa with "
                         "XY >= 80, e.g. sm_80, sm_90a")
    return arch.strip()


def parse_arch_list(text: str, where: str = "--arch") -> list[str]:
    """``sm_80,sm_90a`` -> ["sm_80", "sm_90a"] (validated, de-duplicated, in order)."""
    archs = [check_arch(a, where) for a in text.split(",") if a.strip()]
    if not archs:
        raise ValueError(f"{where}: no arch given; expected e.g. sm_90a or sm_80,sm_90a")
    return list(dict.fromkeys(archs))


def arch_for_capability(major: int, minor: int) -> str:
    """The nvcc arch for a compute capability: sm_90a on Hopper (its arch-specific features), else sm_XY."""
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


@lru_cache(maxsize=1)
def _driver_capabilities() -> tuple[tuple[int, int], ...]:
    """(major, minor) of each GPU the driver sees; () without a driver or a GPU."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return ()
    try:
        if cuda.cuInit(0) != 0:
            return ()
        count = ctypes.c_int(0)
        if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return ()
        caps = []
        for i in range(count.value):
            dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
            if (cuda.cuDeviceGet(ctypes.byref(dev), i) != 0
                    or cuda.cuDeviceGetAttribute(ctypes.byref(major), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                                 dev) != 0
                    or cuda.cuDeviceGetAttribute(ctypes.byref(minor), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                                 dev) != 0):
                return ()
            caps.append((major.value, minor.value))
        return tuple(caps)
    except (AttributeError, OSError):
        return ()


def local_archs() -> list[str]:
    """The archs of the GPUs on this machine, in device order, without repeats."""
    return list(dict.fromkeys(arch_for_capability(*cap) for cap in _driver_capabilities()))


def build_archs(cli: str | None = None) -> tuple[list[str], str]:
    """(the archs a warm targets for specs that name none, where that came from)."""
    if cli:
        return parse_arch_list(cli), "--arch"
    override = knobs.ARCH_OVERRIDE.get()
    if override:
        return [override], knobs.ARCH_OVERRIDE.name
    local = local_archs()
    if local:
        return local, "the local GPU" + ("s" if len(local) > 1 else "")
    fallback = knobs.ARCH.get()
    if fallback:
        return [fallback], knobs.ARCH.name
    return [DEFAULT_ARCH], "the default (no GPU here)"


def runtime_arch(major: int, minor: int) -> str:
    """The arch a kernel for a GPU of this capability is built for: the GPU's own, unless overridden."""
    return knobs.ARCH_OVERRIDE.get() or arch_for_capability(major, minor)
