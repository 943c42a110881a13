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

Needs nvcc 13.x, c++ and network (once, for the host's tvm-ffi wheel and three small pure-Python packages);
no GPU and no CUDA driver: a stub libcuda.so.1 is linked against when none is installed. MAX_JOBS (default
2) sets ninja's parallelism. The bundle is extracted into /tmp/fi and built with FLASHINFER_WORKSPACE_BASE
/tmp/fiws (the GPU machine's paths); --stage picks another workspace.

How the GPU machine must pick them up. FlashInfer never trusts a .so under its JIT directory
(.cache/flashinfer/0.7.2.post1/90a/cached_ops/<uri>/<uri>.so): it always re-runs ninja there, and ninja
rebuilds when build.ninja's command lines differ (they hold the Python include dir and CUDA_HOME of the
machine) or when any header is newer than the objects (pip installs tvm-ffi's headers with the install time
as mtime). The one path loaded without ninja is the AOT directory <flashinfer package>/data/aot/<uri>/
<uri>.so, so the archive also holds .cache/aot/<uri>/<uri>.so (hard links to the same files, no extra size)
and setup_flashinfer in gpu_check.sh needs, after extracting fi-jit.tar.xz:

    [ -d /tmp/fiws/.cache/aot ] && ln -sfn /tmp/fiws/.cache/aot /tmp/fi/site/flashinfer/data/aot

A module missing there is JIT-compiled as before. --verify loads every packed module here through that path
with FLASHINFER_DISABLE_JIT=1 (FlashInfer raises instead of compiling when it does not find one).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FI_ROOT = Path("/tmp/fi")           # where gpu_check.sh extracts .bench/flashinfer.tar.xz
STAGE = Path("/tmp/fiws")           # gpu_check.sh's FLASHINFER_WORKSPACE_BASE
ARCH = "9.0a"                       # gpu_check.sh's FLASHINFER_CUDA_ARCH_LIST
HOST_DEPS = ["nvidia-ml-py", "einops", "tabulate"]   # imported by `import flashinfer`, not by the kernels

# name -> (kind, head_dim, sliding window, logits soft-cap). fa2 is what every project call site uses today
# (bench.py, model.py, engine.py, profile_kernels.py: backend="fa2", and BatchDecodeWithPagedKVCacheWrapper
# with use_tensor_cores=True, which plans through the same fa2 prefill module); page is append_paged_kv_cache.
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
}


def make_spec(name: str):
    """The JitSpec FlashInfer's wrappers build for this module (prefill.py get_batch_prefill_module)."""
    import torch
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module, gen_batch_prefill_module
    from flashinfer.jit.page import gen_page_module

    kind, d, window, cap = MODULES[name]
    if kind == "page":
        return gen_page_module()
    # (backend, q, kv, o, idx dtype, head_dim_qk, head_dim_vo, pos_encoding_mode NONE, use_sliding_window,
    #  use_logits_soft_cap, use_fp16_qk_reduction): BatchPrefillWithPagedKVCacheWrapper.plan's get_module_args
    args = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, d, d, 0, window, cap, False)
    gen = _gen_batch_prefill_primary_module if kind == "fa2" else gen_batch_prefill_module
    return gen(kind, *args)


def wrapper_module(name: str):
    """Load the module the way a wrapper's plan() does (registers FlashInfer's custom ops too)."""
    import torch
    from flashinfer.page import get_page_module
    from flashinfer.prefill import get_batch_prefill_module

    kind, d, window, cap = MODULES[name]
    if kind == "page":
        return get_page_module()
    return get_batch_prefill_module(kind, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, d, d, 0,
                                    window, cap, False)


# --- environment (parent process) ------------------------------------------------------------------------

def sh(*cmd, **kw):
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def setup(bundle: Path) -> dict:
    """Extract the bundle, install a tvm-ffi wheel for this Python, the host deps, a libcuda stub; the env."""
    site = FI_ROOT / "site"
    if not (site / "flashinfer").is_dir():
        FI_ROOT.mkdir(parents=True, exist_ok=True)
        with tarfile.open(bundle) as t:
            t.extractall(FI_ROOT)
    wheel = sorted(FI_ROOT.glob("apache_tvm_ffi-*.whl"))
    if not wheel:
        raise SystemExit(f"no apache_tvm_ffi wheel in {FI_ROOT}: is {bundle} the FlashInfer bundle?")
    tvm_version = wheel[0].name.split("-")[1]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if not glob.glob(str(site / "tvm_ffi" / "core.*")) or not glob.glob(str(site / "tvm_ffi" / f"core.cpython-{tag[2:]}*")):
        host_whl = FI_ROOT / "host-wheels"
        local = [w for w in wheel if f"-{tag}-" in w.name]
        if not local:
            sh(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", host_whl,
               f"apache-tvm-ffi=={tvm_version}")
            local = sorted(host_whl.glob(f"apache_tvm_ffi-*-{tag}-*.whl"))
        # the same target as on the GPU machine, so tvm-ffi's include dir in build.ninja is the same path
        sh(sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade", "--target", site,
           local[0])
    deps = FI_ROOT / "host-deps"
    if not deps.is_dir():
        sh(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", deps, *HOST_DEPS)
    env = dict(os.environ)
    cuda_home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if not cuda_home:   # FlashInfer's own guess (dirname of `which nvcc`) is wrong for a wrapper script
        found = [str(Path(c).parents[1]) for c in ("/usr/local/cuda/bin/nvcc", Path(shutil.which("nvcc") or
                 "/usr/local/cuda/bin/nvcc").resolve()) if Path(c).parents[1].joinpath("include", "cuda.h").exists()]
        if not found:
            raise SystemExit("set CUDA_HOME: no nvcc with include/cuda.h beside it")
        cuda_home = found[0]
    env.update(PYTHONPATH=f"{site}:{deps}", CUDA_HOME=cuda_home, FLASHINFER_CUDA_ARCH_LIST=ARCH,
               MAX_JOBS=env.get("MAX_JOBS", "2"))
    has_libcuda = "libcuda.so" in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout or \
        Path(cuda_home, "lib64", "stubs", "libcuda.so").exists()
    if not has_libcuda:   # link-time stand-in: the .so records DT_NEEDED libcuda.so.1, resolved by the driver there
        stub = FI_ROOT / "libcuda-stub"
        if not (stub / "libcuda.so").exists():
            stub.mkdir(parents=True, exist_ok=True)
            (stub / "empty.c").write_text("")
            sh("cc", "-shared", "-o", stub / "libcuda.so", stub / "empty.c", "-Wl,-soname,libcuda.so.1")
        env["LIBRARY_PATH"] = f"{stub}:{env['LIBRARY_PATH']}" if env.get("LIBRARY_PATH") else str(stub)
    return env


# --- child process (flashinfer importable, env set) ------------------------------------------------------

def child_build(names: list[str], verbose: bool) -> None:
    from flashinfer.jit import env as jit_env

    report = STAGE_AOT() / "prebuild.json"
    done = json.loads(report.read_text()) if report.exists() else {}
    for name in names:
        spec = make_spec(name)
        print(f"== {name}: {spec.name}", flush=True)
        t = time.time()
        spec.build(verbose=verbose)
        secs = round(time.time() - t, 1)
        so = spec.jit_library_path
        aot = STAGE_AOT() / spec.name / so.name
        aot.parent.mkdir(parents=True, exist_ok=True)
        if aot.exists():
            aot.unlink()
        os.link(so, aot)
        done[name] = {"uri": spec.name, "seconds": secs, "bytes": so.stat().st_size,
                      "jit_dir": str(Path(jit_env.FLASHINFER_JIT_DIR).relative_to(STAGE))}
        report.write_text(json.dumps(done, indent=1, sort_keys=True) + "\n")
        print(f"   built in {secs} s, {so.stat().st_size / 2**20:.1f} MiB: {so}", flush=True)


def child_verify(names: list[str]) -> None:
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    for name in names:
        m = wrapper_module(name)
        print(f"   verify {name}: loaded without compiling ({type(m).__name__})", flush=True)


def STAGE_AOT() -> Path:
    return Path(os.environ["FLASHINFER_WORKSPACE_BASE"]) / ".cache" / "aot"


# --- packing ------------------------------------------------------------------------------------------------

def pack(stage: Path, out: Path) -> None:
    """.cache/aot/<uri>/<uri>.so and the JIT dir's <uri>.so + build.ninja (hard links: stored once)."""
    done = json.loads((stage / ".cache" / "aot" / "prebuild.json").read_text())
    files = [".cache/aot/prebuild.json"]
    for rec in done.values():
        uri = rec["uri"]
        files += [f".cache/aot/{uri}/{uri}.so", f"{rec['jit_dir']}/{uri}/{uri}.so", f"{rec['jit_dir']}/{uri}/build.ninja"]
    files = [f for f in files if (stage / f).exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, delete=False) as tmp:
        tar = subprocess.Popen(["tar", "-C", str(stage), "-cf", "-", *files], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-T0", "-3"], stdin=tar.stdout, stdout=tmp, check=True)
        if tar.wait():
            raise SystemExit("tar failed")
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

    env = setup(args.bundle)
    env["FLASHINFER_WORKSPACE_BASE"] = str(args.stage)
    me = [sys.executable, str(Path(__file__).resolve())]
    if args.list:
        sh(*me, "--child", "list", env=env)
        return
    if names:
        sh(*me, *names, "--child", "build", *(["--verbose"] if args.verbose else []), env=env)
    if args.verify:
        report = json.loads((args.stage / ".cache" / "aot" / "prebuild.json").read_text())
        link = FI_ROOT / "site" / "flashinfer" / "data" / "aot"
        if link.is_symlink() or not link.exists():
            if link.is_symlink():
                link.unlink()
            link.symlink_to(args.stage / ".cache" / "aot")
        venv = dict(env)
        stub = FI_ROOT / "libcuda-stub"
        if (stub / "libcuda.so").exists():    # dlopen needs a libcuda.so.1 that defines the symbols used
            syms = set()
            for rec in report.values():
                so = args.stage / ".cache" / "aot" / rec["uri"] / f"{rec['uri']}.so"
                out = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True).stdout
                syms |= {ln.split()[-1] for ln in out.splitlines() if ln.split() and ln.split()[-1].startswith("cu")}
            rt = stub / "runtime"
            rt.mkdir(exist_ok=True)
            (rt / "stub.c").write_text("".join(f"int {s}(void) {{ return 999; }}\n" for s in sorted(syms)))
            sh("cc", "-shared", "-fPIC", "-o", rt / "libcuda.so.1", rt / "stub.c", "-Wl,-soname,libcuda.so.1")
            venv["LD_LIBRARY_PATH"] = f"{rt}:{env.get('LD_LIBRARY_PATH', '')}"
        sh(*me, *[n for n in report], "--child", "verify", env=venv)
    if args.pack:
        pack(args.stage, args.pack)


if __name__ == "__main__":
    main()
