"""The sm90 consumer's main loop in SASS, counted: what a kernel change does to the loop, before any GPU run.

    python3 benchmarks/sm90_sass.py                       # the benchmark spec: paged causal d128 p16 g4 bf16
    python3 benchmarks/sm90_sass.py --kv e4m3 --tile kv128t8 --json out.json

The overlapped main loop is found by its two waits: ``wgmma.wait_group 1`` once S(j) and P(j-1) V(j-1) are issued,
then ``wait_group 0``; the loop is the innermost backward branch around them. For the loop and for the stretch
between the two waits (the softmax) the report gives the instructions by opcode, the MUFU.EX2 between the waits (0
means ptxas hoisted the second wait above the softmax, so the softmax no longer runs under P V: RESULTS.md, run 47),
and the stall cycles ptxas encoded (each instruction's 4-bit stall count, bits 105-108 of its 128-bit word): the
issue time the compiler itself schedules, to which scoreboards, barriers and busy pipes add on the GPU. It cannot
say which of those dominates: the timeline (benchmarks/sm90_timeline.py) and Nsight Compute can. The counts are of
the static code: both sides of a branch (the diagonal tile's mask, the conditional rescale of O) count once.

Needs nvcc and cuobjdump (``pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm``), no GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnjit.generator import render  # noqa: E402
from attnjit.specs import AttentionSpec  # noqa: E402
from attnjit.toolchain import cuobjdump, flags_for, nvcc  # noqa: E402
from benchmarks.sm90_timeline import _spec  # noqa: E402

_INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\* (0x[0-9a-f]+) \*/")
_WORD = re.compile(r"\s*/\* (0x[0-9a-f]+) \*/")


def spec_for(kv: str | None = None, tile: str | None = None, head_dim: int = 128) -> AttentionSpec:
    """The benchmark spec (causal, bf16 q, page 16), the timeline tool's: over a bf16 cache unless ``kv``."""
    return _spec(True, kv or "bf16", tile=tile, head_dim=head_dim)


def sass_of(spec: AttentionSpec) -> str:
    """The spec's (first) kernel compiled here and disassembled (cuobjdump -sass): a default module also holds the
    long-batch tile (sm90.LONG_TILE), whose function is left out."""
    return function_of(_module_sass(spec), spec)


def function_of(module_sass: str, spec: AttentionSpec) -> str:
    """The SASS of the spec's (first) kernel in the disassembly of its module."""
    from attnjit.families import sm90

    name = sm90.tiles(spec)[0].kernel
    parts = re.split(r"^\s*Function : ", module_sass, flags=re.M)
    return "Function : " + next(part for part in parts[1:] if part.split(None, 1)[0] == name)


def _module_sass(spec: AttentionSpec) -> str:
    tool = cuobjdump()
    if tool is None:
        raise SystemExit("sm90_sass.py: cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as d:
        src, cubin = Path(d) / "k.cu", Path(d) / "k.cubin"
        src.write_text(render(spec).source)
        proc = subprocess.run([str(nvcc().path), *flags_for(spec.arch), "-o", str(cubin), str(src)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"sm90_sass.py: nvcc failed:\n{proc.stderr[-3000:]}")
        return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


def instructions(sass: str) -> list[tuple[int, str, int]]:
    """(address, text, the upper 64 bits of the encoding) of each instruction."""
    out, pending = [], None
    for line in sass.splitlines():
        m = _INSN.match(line)
        if m:
            pending = (int(m.group(1), 16), m.group(2).strip().rstrip(";").strip())
            continue
        w = _WORD.match(line)
        if w and pending is not None:
            out.append((*pending, int(w.group(1), 16)))
            pending = None
    return out


def opcode(text: str) -> str:
    toks = text.split()
    op = toks[1] if toks and toks[0].startswith("@") and len(toks) > 1 else (toks[0] if toks else "")
    return op.split(".")[0]


def _summary(insns: list[tuple[int, str, int]]) -> dict:
    ops = Counter(opcode(t) for _, t, _ in insns)
    return {"instructions": len(insns), "stall_cycles": sum((hi >> 41) & 0xF for _, _, hi in insns),
            "opcodes": dict(ops.most_common())}


def loop_bounds(ins: list[tuple[int, str, int]]) -> tuple[int, int, int, int]:
    """(first, last, wait 1, wait 0): instruction indices of the overlapped main loop and of its two waits."""
    w1 = next((i for i, (_, t, _) in enumerate(ins) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in t), None)
    if w1 is None:
        raise ValueError("no wgmma.wait_group 1 in the kernel: not the overlapped sm90 main loop (head_dim 256?)")
    w0 = next(i for i in range(w1, len(ins)) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in ins[i][1])
    at = {a: i for i, (a, _, _) in enumerate(ins)}  # address -> instruction index
    loops = []  # (first, last) instruction index of each backward branch around the two waits
    for j, (_, t, _) in enumerate(ins):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)\s*$", t)
        first = at.get(int(m.group(1), 16)) if m else None
        if first is not None and first <= w1 and j >= w0:  # first <= w1 < j: a backward branch
            loops.append((first, j))
    if not loops:
        raise ValueError("no backward branch around the main loop's waits")
    first, last = min(loops, key=lambda r: r[1] - r[0])
    return first, last, w1, w0


def analyze(sass: str) -> dict:
    """The main loop and its softmax stretch, counted (see the module docstring)."""
    ins = instructions(sass)
    first, last, w1, w0 = loop_bounds(ins)
    soft = ins[w1:w0 + 1]
    return {"loop": _summary(ins[first:last + 1]), "softmax": _summary(soft),
            "mufu_between_waits": sum(opcode(t) == "MUFU" and "EX2" in t for _, t, _ in soft),
            "hgmma_in_loop": sum(opcode(t) == "HGMMA" for _, t, _ in ins[first:last + 1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", default=None, help="the cache's type when not q's: e4m3 or e5m2")
    ap.add_argument("--tile", default=None, help="an sm90 tile configuration (kv128q1, kv64s3, kv128t8, ...)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--variant", default=None, help="module:attribute, e.g. attnjit.variants:SOFTCAP")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec = spec_for(args.kv, args.tile, args.head_dim)
    if args.variant:
        spec = dataclasses.replace(spec, variant=args.variant)
    rep = {"spec": spec.short_name(), **analyze(sass_of(spec))}
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))
    print(f"{rep['spec']}: {rep['hgmma_in_loop']} HGMMA a loop iteration, {rep['mufu_between_waits']} MUFU.EX2 "
          "between the two waits")
    for part in ("loop", "softmax"):
        r = rep[part]
        top = ", ".join(f"{k} {v}" for k, v in list(r["opcodes"].items())[:10])
        print(f"  {part:8s} {r['instructions']:4d} instructions, {r['stall_cycles']:4d} encoded stall cycles: {top}")


if __name__ == "__main__":
    main()
