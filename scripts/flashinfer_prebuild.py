#!/usr/bin/env python3
"""Prebuild FlashInfer 0.7.2's JIT attention modules for the H200 (sm_90a) on a machine without a GPU.

FlashInfer JIT-compiles each attention module on first use (~26 s for an fa2 module, ~110 s for an fa3 one
on the GPU machine's 16 cores). This script compiles the same modules here, with FlashInfer's own module
generators and the exact arguments its wrappers pass on the H200 (bf16 q/kv/o, int32 indices, sm 9.0a), and
packs them as .bench/fi-jit.tar.xz, which scripts/gpu_check.sh extracts into /tmp/fiws (its
FLASHINFER_WORKSPACE_BASE) on the GPU machine.

    bash ../shared/tools/flashinfer-bundle.sh .bench              # .bench/flashinfer.tar.xz
    python3 scripts/flashinfer_prebuild.py --list                  # the modules and their URIs
    python3 scripts/flashinfer_prebuild.py fa2-128 page --pack .bench/fi-jit.tar.xz
    python3 scripts/flashinfer_prebuild.py all --pack .bench/fi-jit.tar.xz --verify
    python3 scripts/flashinfer_prebuild.py fa2-128-e4m3 decode-128-e4m3 --pack .bench/fi-jit-fp8.tar.xz --verify

Needs nvcc 13.x, c++, torch (any build, CPU is fine: FlashInfer imports it; only its C++ ABI flag enters the
compile) and network once: the tvm-ffi wheel for this Python (the bundle's is cp312), three pure-Python
imports of `import flashinfer`, and cuRAND's headers when the toolkit lacks them (CUTLASS includes them).
No GPU and no driver: FLASHINFER_CUDA_ARCH_LIST=9.0a replaces device detection, and an empty libcuda.so
stands in for -lcuda at link time where none is installed (the modules call no driver API, so the linker's
--as-needed drops it). MAX_JOBS (default 2) sets ninja's parallelism. The bundle is extracted into /tmp/fi
and built with FLASHINFER_WORKSPACE_BASE=/tmp/fiws, the GPU machine's paths; --stage picks another one.
Each module's build time lands in <stage>/.cache/aot/prebuild.json.

How the GPU machine must pick them up. FlashInfer never trusts a .so under its JIT directory
(.cache/flashinfer/0.7.2.post1/90a/cached_ops/<uri>/<uri>.so): it always re-runs ninja there, and ninja
rebuilds when build.ninja's command lines differ (they hold the machine's compiler, CUDA_HOME and Python
include dir: /opt/gcc/bin/g++ and /usr/include/python3.12 on the GPU machine) or when any header is newer
than the objects (pip installs tvm-ffi's headers with the install time as mtime). The one path loaded
without ninja is the AOT directory <flashinfer package>/data/aot/<uri>/<uri>.so, checked for presence only
(no hash, no version), so the archive also holds .cache/aot/<uri>/<uri>.so (hard links to the same files,
no extra size) and setup_flashinfer in gpu_check.sh needs, after extracting fi-jit.tar.xz:

    [ -d /tmp/fiws/.cache/aot ] && ln -sfn /tmp/fiws/.cache/aot /tmp/fi/site/flashinfer/data/aot

A module missing there (or failing to load) is JIT-compiled as before. Rebuild the archive whenever the
bundle's FlashInfer version changes: a stale AOT module would be loaded without any check. --verify loads
every built module here through that path with FLASHINFER_DISABLE_JIT=1 (FlashInfer then raises instead of
compiling when it does not find one). The device code equals a GPU-machine JIT build's (same nvcc 13.0:
identical SASS for fa2-128 and fa3-128); the host code needs only libcudart.so.13, libstdc++ (GLIBCXX 3.4.29,
gcc >= 11) and glibc 2.14, and resolves tvm-ffi's C symbols from the libtvm_ffi.so that `import tvm_ffi`
loads, so neither Python's nor torch's version enters it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FI_ROOT = Path("/tmp/fi")             # where gpu_check.sh extracts .bench/flashinfer.tar.xz
STAGE = Path("/tmp/fiws")             # gpu_check.sh's FLASHINFER_WORKSPACE_BASE
ARCH = "9.0a"                         # gpu_check.sh's FLASHINFER_CUDA_ARCH_LIST
CURAND = "nvidia-curand==10.4.0.35"   # CUDA 13.0's cuRAND, for its headers where the toolkit lacks them
HOST_DEPS = ["nvidia-ml-py", "einops", "tabulate"]   # imported by `import flashinfer`, not by the kernels

# name -> (kind, head_dim, sliding window, logits soft-cap[, kv dtype]). fa2 is what every project call site uses
# today (bench.py, model.py, engine.py, profile_kernels.py pass backend="fa2"; BatchDecodeWithPagedKVCacheWrapper
# with use_tensor_cores=True plans through the same fa2 prefill module); page is append_paged_kv_cache. The fp8
# rows of benchmarks/fp8.py (bf16 q over an e4m3 cache) run FlashInfer's decode wrapper both ways: with
# use_tensor_cores=True through the fa2 prefill module with an e4m3 kv type (FA3 needs fp8 q for an fp8 cache),
# without it through the CUDA-core batch decode module ("decode" kind).
MODULES = {
    "fa2-128": ("fa2", 128, False, False),
    "page": ("page", 0, False, False),
    "fa3-128": ("fa3", 128, False, False),
    "fa2-128-softcap": ("fa2", 128, False, True),
    "fa2-128-window": ("fa2", 128, True, False),
    "fa2-64": ("fa2", 64, False, False),
    "fa2-256": ("fa2", 256, False, False),
    "fa3-64": ("fa3", 64, False, False),
    "fa3-256": ("fa3", 256, False, False),
    "fa3-128-softcap": ("fa3", 128, False, True),
    "fa3-128-window": ("fa3", 128, True, False),
    "fa2-128-e4m3": ("fa2", 128, False, False, "float8_e4m3fn"),
    "decode-128-e4m3": ("decode", 128, False, False, "float8_e4m3fn"),
}


def module_args(name: str) -> tuple:
    """get_batch_prefill_module's arguments as BatchPrefillWithPagedKVCacheWrapper.plan builds them: q, kv, o
    and index dtypes, head_dim_qk, head_dim_vo, pos_encoding_mode (0: NONE), use_sliding_window,
    use_logits_soft_cap, use_fp16_qk_reduction; get_batch_decode_module's ("decode" kind) lack the last."""
    import torch

    kind, d, window, cap, *kv = MODULES[name]
    kv_dtype = getattr(torch, kv[0]) if kv else torch.bfloat16
    args = (torch.bfloat16, kv_dtype, torch.bfloat16, torch.int32, d, d, 0, window, cap)
    return args if kind == "decode" else args + (False,)


def make_spec(name: str):
    """The JitSpec that get_batch_prefill_module (prefill.py) builds for this module."""
    from flashinfer.jit.attention.modules import (_gen_batch_prefill_primary_module, gen_batch_decode_module,
                                                  gen_batch_prefill_module)
    from flashinfer.jit.page import gen_page_module

    kind = MODULES[name][0]
    if kind == "page":
        return gen_page_module()
    if kind == "decode":
        return gen_batch_decode_module(*module_args(name))
    gen = _gen_batch_prefill_primary_module if kind == "fa2" else gen_batch_prefill_module
    return gen(kind, *module_args(name))


def wrapper_module(name: str):
    """Load the module the way a wrapper's plan() does (this registers FlashInfer's custom ops too)."""
    from flashinfer.decode import get_batch_decode_module
    from flashinfer.page import get_page_module
    from flashinfer.prefill import get_batch_prefill_module

    kind = MODULES[name][0]
    if kind == "decode":
        return get_batch_decode_module(*module_args(name))
    return get_page_module() if kind == "page" else get_batch_prefill_module(kind, *module_args(name))


# --- environment (parent process) ------------------------------------------------------------------------

def sh(*cmd, **kw):
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def pip(*args) -> None:
    sh(sys.executable, "-m", "pip", *args)


def find_cuda_home() -> str:
    """CUDA_HOME, else the toolkit of the nvcc on PATH (FlashInfer's own guess, dirname(dirname(which nvcc)),
    is wrong where nvcc is a wrapper script in /usr/local/bin)."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return os.environ.get("CUDA_HOME") or os.environ["CUDA_PATH"]
    nvcc = Path(shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc").resolve()
    for home in (Path("/usr/local/cuda"), nvcc.parents[1]):
        if (home / "bin" / "nvcc").exists() and (home / "include" / "cuda.h").exists():
            return str(home)
    raise SystemExit("flashinfer_prebuild: set CUDA_HOME (no toolkit with bin/nvcc and include/cuda.h found)")


def setup(bundle: Path, stage: Path) -> dict:
    """Extract the bundle; install tvm-ffi for this Python, the host deps, cuRAND headers and a libcuda stub
    where missing; return the environment of the child that imports flashinfer."""
    site = FI_ROOT / "site"
    if not (site / "flashinfer").is_dir():
        if not bundle.exists():
            raise SystemExit(f"flashinfer_prebuild: no {bundle}; run ../shared/tools/flashinfer-bundle.sh .bench")
        FI_ROOT.mkdir(parents=True, exist_ok=True)
        with tarfile.open(bundle) as t:
            t.extractall(FI_ROOT)
    wheels = sorted(FI_ROOT.glob("apache_tvm_ffi-*.whl"))
    if not wheels:
        raise SystemExit(f"flashinfer_prebuild: no apache_tvm_ffi wheel in {FI_ROOT}; is {bundle} the bundle?")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if not list((site / "tvm_ffi").glob(f"core.cpython-{tag[2:]}*")):
        host = [w for w in wheels if f"-{tag}-" in w.name]
        if not host:   # the bundle carries the GPU machine's cp312 wheel; fetch the same version for this Python
            pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", FI_ROOT / "host-wheels",
                f"apache-tvm-ffi=={wheels[0].name.split('-')[1]}")
            host = sorted((FI_ROOT / "host-wheels").glob(f"apache_tvm_ffi-*-{tag}-*.whl"))
        # into the bundle's site, as on the GPU machine, so its include dir is the same path in build.ninja
        pip("install", "-q", "--no-index", "--no-deps", "--upgrade", "--target", site, host[0])
    deps = FI_ROOT / "host-deps"
    if not deps.is_dir():
        pip("install", "-q", "--no-deps", "--target", deps, *HOST_DEPS)
    cuda_home = find_cuda_home()
    env = dict(os.environ, PYTHONPATH=f"{site}:{deps}", CUDA_HOME=cuda_home, FLASHINFER_CUDA_ARCH_LIST=ARCH,
               FLASHINFER_WORKSPACE_BASE=str(stage), MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    if not Path(cuda_home, "include", "curand_kernel.h").exists():   # CUTLASS's util headers include it (fa3)
        inc = FI_ROOT / "curand" / "include"
        if not (inc / "curand_kernel.h").exists():
            pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", FI_ROOT / "curand-whl", CURAND)
            with zipfile.ZipFile(sorted((FI_ROOT / "curand-whl").glob("nvidia_curand-*.whl"))[0]) as z:
                inc.mkdir(parents=True, exist_ok=True)
                for n in z.namelist():
                    if "/include/" in n and n.endswith(".h"):
                        (inc / Path(n).name).write_bytes(z.read(n))
        env["FLASHINFER_EXTRA_CUDAFLAGS"] = f"{env.get('FLASHINFER_EXTRA_CUDAFLAGS', '')} -isystem {inc}".strip()
    if not has_libcuda(cuda_home):   # -lcuda needs a file to link against; the modules use no driver API
        stub = FI_ROOT / "libcuda-stub"
        if not (stub / "libcuda.so").exists():
            stub.mkdir(parents=True, exist_ok=True)
            (stub / "empty.c").write_text("")
            sh("cc", "-shared", "-o", stub / "libcuda.so", stub / "empty.c", "-Wl,-soname,libcuda.so.1")
        env["LIBRARY_PATH"] = ":".join(p for p in (str(stub), env.get("LIBRARY_PATH")) if p)
    return env


def has_libcuda(cuda_home: str) -> bool:
    ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return "libcuda.so" in ldconfig or Path(cuda_home, "lib64", "stubs", "libcuda.so").exists()


def runtime_env(env: dict, sos: list[Path]) -> dict:
    """For --verify: where a module NEEDs libcuda.so.1 and no driver is installed, a stub defining its symbols."""
    needs = [so for so in sos if "libcuda.so" in subprocess.run(["readelf", "-d", str(so)], capture_output=True,
                                                               text=True).stdout]
    if not needs or has_libcuda(env["CUDA_HOME"]):
        return env
    syms = set()
    for so in needs:
        out = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True).stdout
        syms |= {w[-1] for w in map(str.split, out.splitlines()) if w and w[-1][:2] == "cu" and w[-1][2:3].isupper()}
    rt = FI_ROOT / "libcuda-stub" / "runtime"
    rt.mkdir(parents=True, exist_ok=True)
    (rt / "stub.c").write_text("".join(f"int {s}(void) {{ return 999; }}\n" for s in sorted(syms)))
    sh("cc", "-shared", "-fPIC", "-o", rt / "libcuda.so.1", rt / "stub.c", "-Wl,-soname,libcuda.so.1")
    return dict(env, LD_LIBRARY_PATH=":".join(p for p in (str(rt), env.get("LD_LIBRARY_PATH")) if p))


# --- child process (flashinfer importable, env set) ------------------------------------------------------

def stage_dirs() -> tuple[Path, Path]:
    stage = Path(os.environ["FLASHINFER_WORKSPACE_BASE"])
    return stage, stage / ".cache" / "aot"


def child_build(names: list[str], verbose: bool) -> None:
    from flashinfer.jit import env as jit_env

    stage, aot_dir = stage_dirs()
    report = aot_dir / "prebuild.json"
    done = json.loads(report.read_text()) if report.exists() else {}
    for name in names:
        spec = make_spec(name)
        print(f"== {name}: {spec.name}", flush=True)
        t = time.time()
        spec.build(verbose=verbose)
        secs = round(time.time() - t, 1)
        so = spec.jit_library_path
        aot = aot_dir / spec.name / so.name
        aot.parent.mkdir(parents=True, exist_ok=True)
        aot.unlink(missing_ok=True)
        os.link(so, aot)
        done[name] = {"uri": spec.name, "seconds": secs, "bytes": so.stat().st_size,
                      "jit_dir": str(Path(jit_env.FLASHINFER_JIT_DIR).relative_to(stage))}
        report.write_text(json.dumps(done, indent=1, sort_keys=True) + "\n")
        print(f"   built in {secs} s, {so.stat().st_size / 2**20:.1f} MiB: {so}", flush=True)


def child_verify(names: list[str]) -> None:
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"   # a module not found through the AOT path raises, not compiles
    for name in names:
        m = wrapper_module(name)
        print(f"   verify {name}: loaded without compiling ({type(m).__name__})", flush=True)


# --- packing ------------------------------------------------------------------------------------------------

def pack(stage: Path, out: Path) -> None:
    """.cache/aot/<uri>/<uri>.so and the JIT dir's <uri>.so + build.ninja (hard links: stored once)."""
    done = json.loads((stage / ".cache" / "aot" / "prebuild.json").read_text())
    files = [".cache/aot/prebuild.json"]
    for rec in done.values():
        uri, jit = rec["uri"], rec["jit_dir"]
        files += [f".cache/aot/{uri}/{uri}.so", f"{jit}/{uri}/{uri}.so", f"{jit}/{uri}/build.ninja"]
    files = [f for f in files if (stage / f).exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, delete=False) as tmp:
        tar = subprocess.Popen(["tar", "-C", str(stage), "-cf", "-", *files], stdout=subprocess.PIPE)
        xz = subprocess.run(["xz", "-T0", "-3"], stdin=tar.stdout, stdout=tmp)
        if tar.wait() or xz.returncode:
            os.unlink(tmp.name)
            raise SystemExit("flashinfer_prebuild: tar | xz failed")
    os.replace(tmp.name, out)
    os.chmod(out, 0o644)
    print(f"packed {len(done)} modules into {out}: {out.stat().st_size / 2**20:.2f} MiB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help=f"module names ({', '.join(MODULES)}) or 'all'")
    ap.add_argument("--list", action="store_true", help="print each module's URI and exit")
    ap.add_argument("--bundle", type=Path, default=ROOT / ".bench" / "flashinfer.tar.xz")
    ap.add_argument("--stage", type=Path, default=STAGE, help="FLASHINFER_WORKSPACE_BASE to build in")
    ap.add_argument("--pack", type=Path, help="write the archive for gpu_check.sh here (.bench/fi-jit.tar.xz)")
    ap.add_argument("--verify", action="store_true", help="load every built module through the AOT path")
    ap.add_argument("--verbose", action="store_true", help="show ninja's compile commands")
    ap.add_argument("--child", choices=["build", "verify", "list"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = list(MODULES) if args.modules == ["all"] else args.modules
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        ap.error(f"unknown modules {unknown}; known: {', '.join(MODULES)}")

    if args.child == "build":
        return child_build(names, args.verbose)
    if args.child == "verify":
        return child_verify(names)
    if args.child == "list":
        for n in MODULES:
            print(f"{n:16} {make_spec(n).name}")
        return

    stage = args.stage.resolve()
    env = setup(args.bundle, stage)
    me = [sys.executable, str(Path(__file__).resolve())]
    if args.list:
        sh(*me, "--child", "list", env=env)
        return
    if names:
        sh(*me, *names, "--child", "build", *(["--verbose"] if args.verbose else []), env=env)
    aot_dir = stage / ".cache" / "aot"
    if args.verify:
        done = json.loads((aot_dir / "prebuild.json").read_text())
        link = FI_ROOT / "site" / "flashinfer" / "data" / "aot"   # what gpu_check.sh's ln -sfn makes
        if link.is_symlink():
            link.unlink()
        if not link.exists():
            link.symlink_to(aot_dir)
        sos = [aot_dir / r["uri"] / f"{r['uri']}.so" for r in done.values()]
        sh(*me, *done, "--child", "verify", env=runtime_env(env, sos))
    if args.pack:
        pack(stage, args.pack)


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as exc:
        cmd = " ".join(map(str, exc.cmd))
        sys.exit(f"flashinfer_prebuild: {cmd[:300]} exited with {exc.returncode} (its output is above)")
