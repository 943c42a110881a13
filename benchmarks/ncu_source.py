"""Summarize `ncu -i REP --page source --csv --print-source sass`: where a kernel's warps stall, by region.

    python benchmarks/ncu_source.py SOURCE.csv [top]

Regions: before the kernel's longest backward branch's target (prologue), inside that loop, after it (epilogue).
Prints the column names, samples per region and the top instructions by stall samples.
"""

from __future__ import annotations

import csv
import re
import sys


def main() -> None:
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    rows = list(csv.reader(open(path, newline="", errors="replace")))
    # skip any preamble lines before the header (the header holds "Address" and "Source")
    h = next(i for i, r in enumerate(rows) if any(c.strip() == "Address" for c in r) and any("Source" in c for c in r))
    header, body = rows[h], [r for r in rows[h + 1:] if len(r) == len(rows[h])]
    print("columns:", [c for c in header][:40])
    col = {c: i for i, c in enumerate(header)}
    a_i, s_i = col["Address"], col["Source"]
    samp = next((i for c, i in col.items() if "Warp Stall Sampling (All" in c), None)
    nis = next((i for c, i in col.items() if "Warp Stall Sampling (Not" in c), None)
    ex = next((i for c, i in col.items() if c.startswith("Instructions Executed")), None)

    def num(r, i):
        if i is None:
            return 0.0
        try:
            return float(r[i].replace(",", "") or 0)
        except ValueError:
            return 0.0

    ins = []
    for r in body:
        try:
            addr = int(r[a_i], 16)
        except ValueError:
            continue
        ins.append((addr, r[s_i].strip(), num(r, samp), num(r, nis), num(r, ex)))
    back = []
    for addr, src, *_ in ins:
        m = re.search(r"BRA.*?0x([0-9a-f]+)", src)
        if m and int(m.group(1), 16) < addr:
            back.append((addr, int(m.group(1), 16)))
    lo, hi = max(back, key=lambda b: b[0] - b[1])[::-1] if back else (0, 0)
    tot = sum(i[2] for i in ins) or 1
    regions = {"prologue": 0.0, "loop": 0.0, "epilogue": 0.0}
    exe = dict.fromkeys(regions, 0.0)
    for addr, _s, sa, _n, e in ins:
        k = "prologue" if addr < lo else "loop" if addr <= hi else "epilogue"
        regions[k] += sa
        exe[k] += e
    print(f"loop {lo:#x}..{hi:#x}; samples {tot:.0f}: " +
          ", ".join(f"{k} {v / tot:.1%} (instr executed {exe[k]:.3g})" for k, v in regions.items()))
    # samples by how often an instruction ran: once per warp (prologue/epilogue) vs once per warp-tile (the loop)
    by_exec: dict[float, list[float]] = {}
    for _a, _s, sa, _n, e in ins:
        b = by_exec.setdefault(e, [0.0, 0.0])
        b[0] += sa
        b[1] += 1
    print("samples by execution count: " + ", ".join(
        f"{e:.0f}x: {v[0] / tot:.1%} ({v[1]:.0f} instr)" for e, v in sorted(by_exec.items(), key=lambda kv: -kv[1][0])[:10]))
    stall_cols = [(c, i) for c, i in col.items() if c.startswith("stall_")]
    if stall_cols:
        sums = {c: sum(num(r, i) for r in body) for c, i in stall_cols}
        st = sum(sums.values()) or 1
        print("stall reasons: " + ", ".join(f"{c[6:]} {v / st:.1%}" for c, v in sorted(sums.items(), key=lambda kv: -kv[1])
                                          if v / st >= 0.01))
        few = [r for r in body if 0 < num(r, ex) <= min(e for e in by_exec if e > 0) * 1.5]
        sums = {c: sum(num(r, i) for r in few) for c, i in stall_cols}
        st2 = sum(sums.values()) or 1
        print(f"  of which in instructions run at most 1.5x the least count ({st2 / st:.1%}): " + ", ".join(
            f"{c[6:]} {v / st2:.1%}" for c, v in sorted(sums.items(), key=lambda kv: -kv[1]) if v / st2 >= 0.02))
    for addr, src, sa, n, e in sorted(ins, key=lambda i: -i[2])[:top]:
        k = "P" if addr < lo else "L" if addr <= hi else "E"
        print(f"{k} {addr:#07x} {sa / tot:6.2%} notissued {n:8.0f} exec {e:10.0f}  {src[:90]}")


if __name__ == "__main__":
    main()
