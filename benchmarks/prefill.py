"""Prefill rows of the benchmark: attnjit on its default family (sm90 on the H200) and on fa2, FlashInfer 0.7.2's fa2
and fa3 backends, and torch SDPA (cuDNN) on the same shapes, in one process.

A row is causal or not, paged (page_size) or ragged, at one head dim; FLOPs = 4 * B * H_q * D * L^2 (halved when
causal), TFLOP/s = FLOPs / time. Every call is timed back to back in the stream (attnjit.timing.time_ms). SDPA runs on
contiguous [B, H_q, L, D] tensors (KV heads expanded), the other three on the same paged/ragged inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import os
from unittest import mock

import torch

import attnjit

H_Q, H_KV, DT = 32, 8, torch.bfloat16


@dataclass(frozen=True)
class Row:
    batch: int
    length: int
    causal: bool = True
    head_dim: int = 128
    page_size: int = 16   # 0: ragged KV
    tag: str = ""         # what the row is for (the table prints it)

    @property
    def shape(self) -> str:
        return f"{self.batch}x{self.length}"

    @property
    def flops(self) -> float:
        full = 4 * self.batch * H_Q * self.head_dim * self.length * self.length
        return full / 2 if self.causal else full

    @property
    def label(self) -> str:
        kv = "ragged" if not self.page_size else f"p{self.page_size}"
        return f"{'causal' if self.causal else 'non-causal'} d{self.head_dim} {kv}"


MAIN = [Row(1, 8192), Row(8, 2048), Row(32, 512)]
EXTRA = [Row(1, 8192, causal=False), Row(8, 2048, causal=False), Row(32, 512, causal=False),
         Row(8, 2048, head_dim=64), Row(8, 2048, head_dim=256), Row(8, 2048, page_size=1, tag="page 1"),
         Row(32, 512, page_size=1, tag="page 1"), Row(8, 2048, page_size=0, tag="ragged")]


def _inputs(row: Row, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, L, d = row.batch, row.length, row.head_dim
    q = torch.randn(b * L, H_Q, d, dtype=DT, device="cuda", generator=gen)
    qo_indptr = torch.arange(0, b * L + 1, L, dtype=torch.int32, device="cuda")
    if not row.page_size:
        k = torch.randn(b * L, H_KV, d, dtype=DT, device="cuda", generator=gen)
        v = torch.randn(b * L, H_KV, d, dtype=DT, device="cuda", generator=gen)
        return q, qo_indptr, (k, v), None
    ps = row.page_size
    pages_per = -(-L // ps)
    total = b * pages_per
    ids = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
    indptr = torch.arange(0, total + 1, pages_per, dtype=torch.int32, device="cuda")
    last = torch.full((b,), L - ps * (pages_per - 1), dtype=torch.int32, device="cuda")
    cache = torch.randn(total, 2, ps, H_KV, d, dtype=DT, device="cuda", generator=gen)
    return q, qo_indptr, cache, (indptr, ids, last)


def _attnjit(ws, row: Row, q, qo_indptr, kv, tables, backend: str, **plan_kw):
    """``backend``: a wrapper backend, or "fa3@TILE" (the sm90 family on one of its tile configurations)."""
    backend, _, tile = backend.partition("@")
    tile = tile or None
    if not row.page_size:
        w = attnjit.BatchPrefillWithRaggedKVCacheWrapper(ws, backend=backend, variant=plan_kw.pop("variant", None),
                                                         tile=tile)
        w.plan(qo_indptr, qo_indptr, H_Q, H_KV, row.head_dim, causal=row.causal, q_data_type=DT, **plan_kw)
        return w, (lambda out, **run: w.run(q, kv[0], kv[1], out=out, **run))
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend, variant=plan_kw.pop("variant", None),
                                                    tile=tile)
    w.plan(qo_indptr, *tables, H_Q, H_KV, row.head_dim, row.page_size, causal=row.causal, q_data_type=DT, **plan_kw)
    return w, (lambda out, **run: w.run(q, kv, out=out, **run))


def _flashinfer(fi, ws, row: Row, q, qo_indptr, kv, tables, backend: str, **plan_kw):
    if not row.page_size:
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(qo_indptr, qo_indptr, H_Q, H_KV, row.head_dim, causal=row.causal, q_data_type=DT, kv_data_type=DT,
               **plan_kw)
        return lambda out: w.run(q, kv[0], kv[1], out=out)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(qo_indptr, *tables, H_Q, H_KV, row.head_dim, row.page_size, causal=row.causal, q_data_type=DT,
           kv_data_type=DT, **plan_kw)
    return lambda out: w.run(q, kv, out=out)


def bench_rows(fi, rows, results, *, time_ms, ws, ws_fi, sdpa: bool = True,
               families=("auto", "auto-strided", "fa2"), fi_backends=("fa2", "fa3"), fi_skip=frozenset(),
               time_many=None) -> None:
    """Append one result dict per row: {impl}_ms and {impl}_tflops for each implementation that ran. ``fi_skip``:
    FlashInfer modules not to run ("fa3:64": its fa3 module at head_dim 64; each costs minutes of JIT on the GPU
    machine when its cache was not carried). The A/B columns (AB: the same default module and process under a
    setting): "auto-notma" with ATTNJIT_TMA=0 (cp.async copies only), "auto-strided" with ATTNJIT_WORK_CLAIMS=0
    (each CTA walks the work list by grid stride instead of claiming items). ``time_many`` (attnjit.timing's): a row's
    implementations timed interleaved, block by block, so that none runs on a GPU the others heated (run 134); None:
    each with ``time_ms``, one after another."""
    for i, row in enumerate(rows):
        q, qo_indptr, kv, tables = _inputs(row, seed=1 + i)
        r = {"op": "prefill", "shape": row.shape, "label": row.label, "tag": row.tag, "flops": row.flops}
        runs: dict[str, object] = {}   # name -> call, each writing its own output
        outs: dict[str, torch.Tensor] = {}
        for backend in families:
            name, env, per_call = AB.get(backend, (f"attnjit_{backend.replace('@', '_')}", {}, False))
            if backend == "auto":
                name = "attnjit"
            with mock.patch.dict(os.environ, env):   # ATTNJIT_WORK_CLAIMS acts in plan()
                w, run = _attnjit(ws, row, q, qo_indptr, kv, tables, "auto" if backend in AB else backend)
            r[f"{name}_plan"] = w.last_plan
            outs[name] = torch.empty_like(q)
            if per_call:   # a setting run() reads (ATTNJIT_TMA): around every call
                runs[name] = (lambda run, out, env: lambda: _with_env(env, run, out))(run, outs[name], env)
            else:
                runs[name] = (lambda run, out: lambda: run(out))(run, outs[name])
        for backend in fi_backends if fi is not None else ():
            name = f"flashinfer_{backend}"
            if f"{backend}:{row.head_dim}" in fi_skip:
                r[f"{name}_error"] = "skipped (--fi-skip: its JIT module was not carried)"
                continue
            try:
                frun = _flashinfer(fi, ws_fi(), row, q, qo_indptr, kv, tables, backend)
                outs[name] = torch.empty_like(q)
                runs[name] = (lambda frun, out: lambda: frun(out))(frun, outs[name])
                runs[name]()   # a backend FlashInfer lacks for this row fails here, before the timing
            except Exception as exc:  # noqa: BLE001 (say so in the row)
                runs.pop(name, None)
                outs.pop(name, None)
                r[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        if sdpa:
            runs.update(_sdpa(row, r))
        if time_many is not None:
            r.update({f"{name}_ms": ms for name, ms in time_many(runs).items()})
        else:
            for name, run in runs.items():
                r[f"{name}_ms"] = time_ms(run)
        first = next(iter(outs), None)   # attnjit's first family: the others' reference
        for name, out in outs.items():
            if name != first:
                r[f"{name}_max_diff"] = (out.float() - outs[first].float()).abs().max().item()
        for k in [k[:-3] for k in r if k.endswith("_ms")]:
            r[f"{k}_tflops"] = row.flops / (r[f"{k}_ms"] * 1e-3) / 1e12
        results.append(r)
        del kv, q, outs, runs
        torch.cuda.empty_cache()


def _with_env(env: dict, run, out) -> None:
    """run(out) with ``env`` set, only its keys touched (patch.dict snapshots and restores all of os.environ: 375 us
    a call on the CI CPU, more than a short row's kernel)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        run(out)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _sdpa(row: Row, r: dict) -> dict:
    """torch SDPA's cuDNN and flash backends on contiguous [B, H_q, L, D] tensors: name -> call (each in its backend's
    context); a backend that fails its first call is an error in ``r``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = (row.batch, H_Q, row.length, row.head_dim)
    qs, ks, vs = (torch.randn(shape, dtype=DT, device="cuda") for _ in range(3))
    runs = {}
    for name, backend in (("sdpa_cudnn", "CUDNN_ATTENTION"), ("sdpa_flash", "FLASH_ATTENTION")):
        def run(backend=getattr(SDPBackend, backend)):
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=row.causal)
        try:
            run()
            runs[name] = run
        except Exception as exc:  # noqa: BLE001
            r[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    return runs


# --- variants on the default family ------------------------------------------------------------------------------

USER_BIAS = attnjit.Variant("user_bias", params={"bias": float}, logits_transform="return logit + bias;")
# (feature, plan() arguments, run() arguments, FlashInfer plan() arguments or None, wrapper variant)
VARIANTS = [("default", {}, {}, {}, None), ("soft-cap 30", {"logits_soft_cap": 30.0}, {}, {"logits_soft_cap": 30.0}, None),
            ("window 1024", {"window_left": 1024}, {}, {"window_left": 1024}, None),
            ("ALiBi", {"pos_encoding_mode": "ALIBI"}, {}, None, None),
            ("user variant (logit + bias)", {}, {"bias": 0.5}, None, USER_BIAS),
            ("default (again: drift)", {}, {}, {}, None)]


def bench_variants(fi, results, *, time_ms, ws, ws_fi, row: Row = Row(8, 2048), fi_backends=("fa3",),
                   fi_skip=frozenset(), time_many=None) -> None:
    """Each built-in and a user variant on the default family, against its default kernel (and FlashInfer's;
    "fa3:variants" in ``fi_skip`` skips FlashInfer's variant modules, "fa3:window" one of them, by the feature's
    first word). ``time_many``: all of them timed interleaved, block by block (else one after another)."""
    q, qo_indptr, kv, tables = _inputs(row, seed=7)
    runs: dict[tuple[int, str], object] = {}   # (feature index, impl) -> call
    outs: dict[tuple[int, str], torch.Tensor] = {}
    rows = []
    for i, (feature, plan_kw, run_kw, fi_kw, variant) in enumerate(VARIANTS):
        r = {"op": "prefill variants", "shape": row.shape, "feature": feature}
        w, run = _attnjit(ws, row, q, qo_indptr, kv, tables, "auto", variant=variant, **plan_kw)
        out = outs[i, "attnjit"] = torch.empty_like(q)
        runs[i, "attnjit"] = (lambda run, out, kw: lambda: run(out, **kw))(run, out, run_kw)
        r["family"] = w.last_plan["family"]
        for backend in fi_backends if fi is not None and fi_kw is not None else ():
            name = f"flashinfer_{backend}"
            if fi_kw and ({f"{backend}:variants", f"{backend}:{feature.split()[0].lower()}"} & fi_skip):
                r[f"{name}_error"] = "skipped (--fi-skip)"
                continue
            try:
                frun = _flashinfer(fi, ws_fi(), row, q, qo_indptr, kv, tables, backend, **fi_kw)
                fout = outs[i, name] = torch.empty_like(q)
                runs[i, name] = (lambda frun, out: lambda: frun(out))(frun, fout)
                runs[i, name]()   # a module that fails, fails here, before the timing
            except Exception as exc:  # noqa: BLE001
                runs.pop((i, name), None)
                outs.pop((i, name), None)
                r[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(r)
    ms = time_many(runs) if time_many is not None else {key: time_ms(run) for key, run in runs.items()}
    for (i, name), value in ms.items():
        rows[i][f"{name}_ms"] = value
        if name != "attnjit":
            rows[i][f"{name}_max_diff"] = (outs[i, "attnjit"].float() - outs[i, name].float()).abs().max().item()
    results.extend(rows)


# the A/B columns: backend name -> (result name, environment), and their table labels
# per_call: the setting is one run() reads, so each timed call runs inside it (_with_env); the others act in plan()
# alone. (Run 142's strided column was timed inside mock.patch.dict around every call, 375 us of host time a call on
# the CI CPU: the host's speed at the short rows, 96 TFLOP/s at 32x512 against 362, not the kernel's.)
AB = {"auto-notma": ("attnjit_notma", {"ATTNJIT_TMA": "0"}, True),
      "auto-strided": ("attnjit_strided", {"ATTNJIT_WORK_CLAIMS": "0"}, False)}
AB_LABELS = (("attnjit_notma", "attnjit no TMA"), ("attnjit_strided", "attnjit strided"))


def table(rows, ceiling: float) -> str:
    impls = [("attnjit", "attnjit"), *((n, label) for n, label in AB_LABELS if any(f"{n}_ms" in r for r in rows)),
             ("attnjit_fa2", "attnjit fa2"),
             ("flashinfer_fa2", "FI fa2"),
             ("flashinfer_fa3", "FI fa3"), ("sdpa_cudnn", "cuDNN")]
    head = "| row | shape | " + " | ".join(n for _, n in impls) + " | attnjit / FI fa3 | attnjit / cuDNN | of ceiling |"
    lines = [head, "|" + "---|" * (len(impls) + 5)]
    for r in rows:
        t = {k: r.get(f"{k}_tflops") for k, _ in impls}
        cells = [f"{t[k]:.0f}" if t[k] else "-" for k, _ in impls]
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
        a = t["attnjit"]
        label = r["label"] + (f" ({r['tag']})" if r.get("tag") else "")
        lines.append(f"| {label} | {r['shape']} | " + " | ".join(cells) +
                     f" | {ratio(a, t['flashinfer_fa3'])} | {ratio(a, t['sdpa_cudnn'])} | {a / ceiling:.0%} |")
    return "\n".join(lines)


def tile_table(rows, tiles) -> str:
    """The sm90 tile sweep: TFLOP/s of each configuration, and each against the first, FlashInfer fa3 and cuDNN."""
    names = [f"attnjit_fa3_{t}" for t in tiles]
    head = "| row | shape | " + " | ".join(tiles) + " | best / first | best / FI fa3 | best / cuDNN |"
    lines = [head, "|" + "---|" * (len(tiles) + 5)]
    for r in rows:
        t = [r.get(f"{n}_tflops") or 0.0 for n in names]
        best = max(t)
        ratio = lambda a, b: f"{a / b:.3f}" if a and b else "-"  # noqa: E731
        label = r["label"] + (f" ({r['tag']})" if r.get("tag") else "")
        lines.append(f"| {label} | {r['shape']} | " + " | ".join(f"{x:.0f}" for x in t) +
                     f" | {ratio(best, t[0])} | {ratio(best, r.get('flashinfer_fa3_tflops'))} |"
                     f" {ratio(best, r.get('sdpa_cudnn_tflops'))} |")
    return "\n".join(lines)


def variant_table(rows) -> str:
    lines = ["| feature | family | attnjit ms | vs attnjit default | FI fa3 ms |", "|---|---|---|---|---|"]
    base = rows[0]["attnjit_ms"] if rows else 1.0
    for r in rows:
        fi_ms = r.get("flashinfer_fa3_ms")
        lines.append(f"| {r['feature']} | {r['family']} | {r['attnjit_ms']:.3f} | {r['attnjit_ms'] / base:.3f} | "
                     f"{f'{fi_ms:.3f}' if fi_ms else r.get('flashinfer_fa3_error', '-')[:40]} |")
    return "\n".join(lines)
