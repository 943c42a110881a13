"""The sm90 consumer's softmax in isolation, and beside another warpgroup's wgmma (benchmarks/softmax_micro.cu).

    python3 benchmarks/softmax_micro.py --build                  # compile here (nvcc, no GPU): .bench/softmax_micro.cubin
    python3 benchmarks/softmax_micro.py [--json out.json]        # run it (GPU; carry .bench)

What it answers: how many cycles one warp's online softmax of a 64 x 128 tile takes (the consumer's instruction mix,
registers only), by part; how much two warps of a sub-partition in their softmax at once cost; and how much a
concurrent wgmma stream of the other warpgroup (S's SS, P V's RS, or both: what ping-pong puts under a softmax)
slows it. And how long issuing a consumer's 16 wgmma takes, with the tensor cores free and shared.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnjit.generator import INCLUDE_DIR  # noqa: E402
from attnjit.toolchain import nvcc  # noqa: E402

SRC = Path(__file__).with_suffix(".cu")
CUBIN = ROOT / ".bench" / "softmax_micro.cubin"
SMS = 132
SMEM = 98304
SOFT = ("soft_full", "soft_no_pack", "soft_no_rescale", "soft_no_exp", "soft_exp_only", "soft_max_only")
BESIDE = ("bg_none", "bg_ss", "bg_rs", "bg_both", "bg_alone", "bg_two")


def build(cubin: Path) -> None:
    cubin.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(nvcc().path), "-arch=sm_90a", "-O3", "-cubin", f"-I{INCLUDE_DIR}", "-o", str(cubin), str(SRC)],
                   check=True)
    print(f"built {cubin}")


def _launch(f, threads: int, iters: int, smem: int = 0):
    import cupy as cp
    import numpy as np

    c = cp.zeros(2 * SMS * 8, dtype=cp.int64)
    f((SMS,), (threads,), (c, np.int32(iters), np.float32(0.125)), shared_mem=smem)
    cp.cuda.runtime.deviceSynchronize()
    return cp.asnumpy(c).reshape(2, SMS, 8)


def run(cubin: Path) -> dict:
    import cupy as cp
    import numpy as np

    mod = cp.RawModule(path=str(cubin))
    res: dict = {}
    for name in SOFT:  # cycles per tile: the difference of two loop lengths (the set-up cancels)
        f = mod.get_function(name)
        for threads in (128, 256):
            short, long_ = _launch(f, threads, 64), _launch(f, threads, 576)
            per = (long_[0, :, :threads // 32] - short[0, :, :threads // 32]) / 512.0
            res[f"{name}/{threads // 128}wg"] = float(np.median(per))
    for name in BESIDE:
        f = mod.get_function(name)
        f.max_dynamic_shared_size_bytes = SMEM
        short, long_ = _launch(f, 256, 64, SMEM), _launch(f, 256, 576, SMEM)
        row = {"group_cycles": float(np.median(long_[0, :, 4:])), "issue_cycles": float(np.median(long_[1, :, 4:]))}
        if name == "bg_two":
            row["group_cycles_wg0"] = float(np.median(long_[0, :, :4]))
        elif name != "bg_alone":
            row["softmax_cycles"] = float(np.median((long_[0, :, :4] - short[0, :, :4]) / 512.0))
        res[name] = row
    return res


def table(res: dict) -> str:
    lines = ["| softmax part (one 64 x 128 tile) | 1 warp / sub-partition | 2 warps at once (each) |",
             "| --- | --- | --- |"]
    for name in SOFT:
        one, two = res[f"{name}/1wg"], res[f"{name}/2wg"]
        lines.append(f"| {name} | {one:.0f} | {two:.0f} ({two / 2:.0f} a tile) |")
    lines += ["", "| warpgroup 1 runs | softmax of warpgroup 0 (cycles) | a wgmma group (cycles) | of which issuing |",
              "| --- | --- | --- | --- |"]
    what = {"bg_none": "nothing", "bg_ss": "8 SS wgmma (S) a group", "bg_rs": "8 RS wgmma (P V) a group",
            "bg_both": "16 (S and P V) a group", "bg_alone": "16 a group, no softmax beside",
            "bg_two": "16 a group, and warpgroup 0 too"}
    for name in BESIDE:
        r = res[name]
        soft = f"{r['softmax_cycles']:.0f}" if "softmax_cycles" in r else "-"
        grp = f"{r['group_cycles']:.0f}" if name != "bg_none" else "-"
        iss = f"{r['issue_cycles']:.0f}" if name != "bg_none" else "-"
        lines.append(f"| {what[name]} | {soft} | {grp} | {iss} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="store_true", help="compile the cubin (no GPU needed) and stop")
    ap.add_argument("--cubin", type=Path, default=CUBIN)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.build:
        return build(args.cubin)
    if not args.cubin.is_file():
        raise SystemExit(f"softmax_micro.py: {args.cubin} not found: run with --build first (here, no GPU needed)")
    res = run(args.cubin)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(table(res))


if __name__ == "__main__":
    main()
