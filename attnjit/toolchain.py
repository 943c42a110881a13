"""nvcc: where it is, what version it is, and the flags a spec's arch compiles with (and cuobjdump, for the tools
and tests that read a kernel's SASS)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import knobs
from .errors import NvccNotFoundError

# Flags every module is built with (besides the arch). Part of every cache key.
BASE_FLAGS = ("-cubin", "-O3", "-std=c++17", "-lineinfo", "-Xptxas=-v")


@dataclass(frozen=True)
class Nvcc:
    path: Path
    version: str  # the full `nvcc --version` text: recorded in each manifest it builds (not in the key)

    @property
    def release(self) -> str:
        m = re.search(r"release ([\d.]+)", self.version)
        return m.group(1) if m else "?"

    @property
    def ident(self) -> str:
        """A short name of this toolchain for manifests, ``cache list`` and ``prune --built-by``:
        ``nvcc 13.0 V13.0.88`` (a hash of the version text stands in for a build id it lacks)."""
        m = re.search(r"\bV(\d+(?:\.\d+)+)", self.version)
        build = f"V{m.group(1)}" if m else "#" + hashlib.sha256(self.version.encode()).hexdigest()[:8]
        return f"nvcc {self.release} {build}"


_version_memo: dict[tuple[str, int, int], str] = {}


def find_nvcc() -> Path:
    """ATTNJIT_NVCC, else $CUDA_HOME/bin/nvcc, else nvcc on PATH."""
    tried: list[str] = []
    explicit = knobs.NVCC.get()
    if explicit is not None:
        if explicit.is_file() and os.access(explicit, os.X_OK):
            return explicit
        raise NvccNotFoundError([f"ATTNJIT_NVCC={explicit} (not an executable file)"])
    tried.append("ATTNJIT_NVCC (unset)")
    cuda_home = knobs.CUDA_HOME.get()
    if cuda_home is not None:
        cand = cuda_home / "bin" / "nvcc"
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
        tried.append(f"$CUDA_HOME/bin/nvcc={cand} (missing)")
    else:
        tried.append("$CUDA_HOME/bin/nvcc (CUDA_HOME unset)")
    on_path = shutil.which("nvcc")
    if on_path:
        return Path(on_path)
    tried.append("nvcc on PATH (none)")
    raise NvccNotFoundError(tried)


def nvcc() -> Nvcc:
    path = find_nvcc()
    st = path.stat()
    memo_key = (str(path), st.st_mtime_ns, st.st_size)
    version = _version_memo.get(memo_key)
    if version is None:
        try:
            proc = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
        except OSError as exc:
            raise NvccNotFoundError([f"{path} (cannot run: {exc})"]) from None
        if proc.returncode != 0:
            raise NvccNotFoundError([f"{path} (`nvcc --version` exited {proc.returncode}: {proc.stderr.strip()})"])
        version = proc.stdout.strip()
        _version_memo[memo_key] = version
    return Nvcc(path, version)


def arch_flags(arch: str) -> tuple[str, ...]:
    """sm_90a -> -gencode=arch=compute_90a,code=sm_90a (the form that enables wgmma/setmaxnreg)."""
    m = re.fullmatch(r"sm_(\d+a?)", arch)
    if not m:
        raise ValueError(f"arch {arch!r} is not of the form sm_XY or sm_XYa")
    return (f"-gencode=arch=compute_{m.group(1)},code=sm_{m.group(1)}",)


def flags_for(arch: str) -> tuple[str, ...]:
    return BASE_FLAGS + arch_flags(arch)


def cuobjdump() -> str | None:
    """cuobjdump from PATH or from the nvidia-cuda-cuobjdump wheel (the test extra installs it); None: neither."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for base in sys.path:
        for cand in Path(base).glob("nvidia/cu*/bin/cuobjdump"):
            return str(cand)
    return None
