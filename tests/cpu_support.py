"""Shared pieces of the CPU suite: the small specs it compiles, CLI runner, nvcc wrapper scripts, tree snapshots.

Everything that compiles goes into temporary cache roots; nothing here reads or writes ~/.cache.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from attnjit.cache import Job
from attnjit.specs import AttentionSpec
from attnjit.toolchain import Nvcc, cuobjdump, flags_for, nvcc

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"

# The specs the session's prebuilt cache holds: cheap to compile (1-3 s each), one of every module shape the
# cache needs (two templates, a module with two attention tiles).
MERGE_FP16 = AttentionSpec(op="merge_state", head_dim=64, dtype="fp16")
MERGE_BF16 = AttentionSpec(op="merge_state", head_dim=64, dtype="bf16")
APPEND_FP16 = AttentionSpec(op="append_kv", head_dim=64, page_size=16, dtype="fp16")
PREFILL_D64 = AttentionSpec(op="prefill", head_dim=64, page_size=16, dtype="fp16", mask="causal", group_size=1,
                            family="fa2")
GOLDEN_SPECS = (MERGE_FP16, MERGE_BF16, APPEND_FP16, PREFILL_D64)


@dataclass(frozen=True)
class Golden:
    """A cache root built once per session. Tests never touch it: they ``copy()`` it and change the copy."""

    root: Path
    specs: tuple[AttentionSpec, ...]
    keys: tuple[str, ...]

    def copy(self, dest: Path) -> Path:
        shutil.copytree(self.root, dest, symlinks=True)  # copystat keeps the 0700 modes
        return dest

    def key(self, spec: AttentionSpec) -> str:
        return self.keys[self.specs.index(spec)]


def entry_dir(root: Path, key: str) -> Path:
    return root / key[:2] / key


def run_cli(*args: str | os.PathLike, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m attnjit.cli ARGS`` in a subprocess with the (test-isolated) environment."""
    return subprocess.run([sys.executable, "-m", "attnjit.cli", *map(str, args)], capture_output=True, text=True,
                          env=env if env is not None else dict(os.environ), cwd=REPO, timeout=timeout)


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def nvcc_wrapper(path: Path, real_nvcc: Path, *, before_compile: str = "", version_suffix: str | None = None) -> Path:
    """A stand-in for nvcc: ``--version`` answers like the real one (plus ``version_suffix``), a compile runs
    ``before_compile`` and then the real nvcc. The version text is part of the cache key."""
    if version_suffix is None:
        version = f'exec "{real_nvcc}" "$@"'
    else:
        version = f'"{real_nvcc}" --version; echo "{version_suffix}"; exit 0'
    return write_script(path, f"""case " $* " in
  *" --version "*) {version} ;;
esac
{before_compile}
exec "{real_nvcc}" "$@"
""")


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """(mode, size, mtime_ns) of every path under root: equal snapshots mean nothing was written."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (stat.S_IMODE(st.st_mode), st.st_size if p.is_file() else 0, st.st_mtime_ns)
    st = root.lstat()
    out["."] = (stat.S_IMODE(st.st_mode), 0, st.st_mtime_ns)
    return out


def parse_summary(stdout: str) -> tuple[int, int, int, int]:
    """(specs, built, cached, failed) from warm's last line ``N specs: B built, C cached, F failed (X s)``."""
    line = stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"(\d+) specs: (\d+) built, (\d+) cached, (\d+) failed \((\d+\.\d) s\)", line)
    assert m, f"warm summary line has the wrong format: {line!r}"
    return tuple(int(g) for g in m.groups()[:4])  # type: ignore[return-value]


def tagged_processes(tag: str) -> list[int]:
    """Processes whose environment holds ``ATTNJIT_TEST_TAG=<tag>`` (children inherit it, whatever their process
    group or session): what a test started, and only that."""
    needle = f"ATTNJIT_TEST_TAG={tag}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def kill_tagged(tag: str) -> None:
    for pid in tagged_processes(tag):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def hidden_nvcc_env(tmp_path: Path, **extra: str) -> tuple[dict[str, str], Path]:
    """An environment with no nvcc anywhere: PATH without it, no CUDA_HOME, and an ATTNJIT_NVCC that leaves a
    mark (and fails) if anything runs it."""
    ran = tmp_path / "nvcc-was-run"
    poison = write_script(tmp_path / "poison-nvcc", f'echo "$@" >> "{ran}"\nexit 97\n')
    (tmp_path / "empty-bin").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
    env.update(PATH=str(tmp_path / "empty-bin"), ATTNJIT_NVCC=str(poison), PYTHONPATH=str(REPO), **extra)
    return env, ran


# --- cache-test pieces (test_cache.py, test_cache_roots.py) ---------------------------------------------------

TINY_SOURCE = 'extern "C" __global__ void attnjit_tiny(int *p) { *p = 42; }\n'
FAKE_NVCC = Nvcc(Path("/nonexistent/nvcc"), "fake nvcc, release 0.0")  # for jobs that never reach a compiler


def cache_job(source: str, *, tool: Nvcc | None = None, label: str = "job", arch: str = "sm_90a") -> Job:
    return Job(source=source, flags=flags_for(arch), nvcc=tool or nvcc(), arch=arch, label=label, meta={})


def holds_no_lock(path: Path) -> bool:
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Exception:  # noqa: BLE001 (filelock.Timeout)
        return False
    lock.release()
    return True


def flip_cubin_byte(d: Path) -> None:
    data = bytearray((d / "kernel.cubin").read_bytes())
    data[len(data) // 3] ^= 0x01
    (d / "kernel.cubin").write_bytes(bytes(data))


# --- real compiles (nvcc, cuobjdump) ------------------------------------------------------------------------------

def compile_kernel(tmp_path: Path, spec: AttentionSpec, *, sass: bool = False,
                   source: str | None = None) -> tuple[str, str | None]:
    """Render ``spec`` (or take its ``source``, e.g. a what-if's) and compile it with nvcc for its arch (asserts
    success): (ptxas log, SASS or None)."""
    from attnjit.generator import render

    src = tmp_path / f"{abs(hash((spec, source)))}.cu"
    cubin = src.with_suffix(".cubin")
    src.write_text(render(spec).source if source is None else source)
    proc = subprocess.run([str(nvcc().path), *flags_for(spec.arch), "-o", str(cubin), str(src)], capture_output=True,
                          text=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    if not sass:
        return log, None
    tool = cuobjdump()
    assert tool is not None, "cuobjdump not found: pip install nvidia-cuda-cuobjdump (the test extra has it)"
    dump = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True)
    assert dump.returncode == 0, (f"cuobjdump -sass failed ({dump.returncode}): {dump.stderr.strip()} (cuobjdump 13.5 "
                                  "needs nvdisasm beside it: pip install nvidia-cuda-nvdisasm, the test extra has it)")
    return log, dump.stdout


def assert_no_spills(log: str, sass: str | None = None, what: str = "the kernel") -> None:
    """ptxas reports no spill stores or loads for any kernel; with ``sass``, no local-memory instruction either."""
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(a == "0" and b == "0" for a, b in spills), log
    if sass is not None:
        assert not re.search(r"\b(LDL|STL)\b", sass), f"local memory in {what}"
