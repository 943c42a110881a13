"""Tokens/s of the example model (attnjit.models) with attnjit's wrappers and with FlashInfer's at the same call
sites, with and without CUDA-graph decode, in one run; and the share of step time spent in attention.

    python benchmarks/model.py [--layers 8] [--batches 1,16,64] [--prompt 1024] [--gen 128] [--json OUT]

Model: Llama-3-8B shapes (hidden 4096, 32 query / 8 KV heads, head_dim 128, SwiGLU 14336, vocab 128256) with
``--layers`` layers, bf16, random weights; page_size 16. Each batch size B runs B requests of ``--prompt`` tokens
(chunked prefill, 8192 tokens per step) then ``--gen`` greedy tokens each. Decode tokens/s counts decode-only steps
(synchronized, host planning included); end-to-end counts every generated token over the whole run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnjit.models import Engine, LlamaConfig, LlamaWeights

ATTN_KERNELS = ("attnjit_attention", "BatchPrefillWithPagedKVCache", "BatchDecodeWithPagedKVCache",
                "MergeStates", "PersistentVariableLengthMergeStates", "VariableLengthMergeStates")
APPEND_KERNELS = ("attnjit_append_kv", "AppendPagedKVCache")


def attention_share(engine: Engine, n_steps: int = 3) -> dict:
    """Profile a few eager steps: GPU time in attention (and KV append) kernels over all kernel time."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.cuda_graphs
    engine.cuda_graphs = False  # kernels inside a replayed graph are not attributed by name
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n_steps):
                if engine.scheduler.has_work:
                    engine.step()
            torch.cuda.synchronize()
    finally:
        engine.cuda_graphs = graphs
    total = attn = append = 0.0
    for evt in prof.events():   # GPU-side events only (CPU ops carry their children's device time too)
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = evt.time_range.elapsed_us()
        if evt.name.startswith(("Memcpy", "Memset")):
            continue
        total += t
        if any(k in evt.name for k in ATTN_KERNELS):
            attn += t
        elif any(k in evt.name for k in APPEND_KERNELS):
            append += t
    return {"attention_share": attn / total if total else None, "append_share": append / total if total else None,
            "kernel_ms_per_step": total / 1e3 / n_steps}


def run_one(config, weights, *, backend: str, graphs: bool, batch: int, prompt: int, gen: int, seed: int) -> dict:
    engine = Engine(config, weights, backend=backend, page_size=16, max_model_len=prompt + gen + 16,
                    max_batch_tokens=8192, max_running=batch, cuda_graphs=graphs)
    g = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        engine.add(torch.randint(0, config.vocab_size, (prompt,), generator=g).tolist(), gen)
    torch.cuda.synchronize()
    engine.run()
    s = engine.stats
    row = {"backend": backend, "graphs": graphs, "batch": batch, "steps": s.steps, "mixed_steps": s.mixed_steps,
           "decode_steps": s.decode_steps, "decode_tok_s": s.decode_tokens / s.decode_time_s if s.decode_time_s else None,
           "e2e_tok_s": s.tokens_out / s.total_time_s, "decode_step_ms": 1e3 * s.decode_time_s / max(s.decode_steps, 1),
           "total_s": s.total_time_s, "tokens": [r.generated[:4] for r in engine.scheduler.finished[:2]]}
    return row, engine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--backends", default="attnjit,flashinfer")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    config = LlamaConfig.llama3_8b(num_layers=args.layers)
    weights = LlamaWeights.random(config, dtype=torch.bfloat16, device="cuda", seed=0)
    rows = []
    backends = [b for b in args.backends.split(",") if b]
    for batch in [int(b) for b in args.batches.split(",")]:
        for backend in backends:
            for graphs in (False, True):
                try:
                    run_one(config, weights, backend=backend, graphs=graphs, batch=batch, prompt=64, gen=4,
                            seed=1)  # warm-up: modules loaded, graphs' allocator pools touched
                    row, engine = run_one(config, weights, backend=backend, graphs=graphs, batch=batch,
                                          prompt=args.prompt, gen=args.gen, seed=2)
                    rows.append(row)
                    del engine
                except Exception as exc:  # noqa: BLE001  (FlashInfer missing or failing: the row says so)
                    rows.append({"backend": backend, "graphs": graphs, "batch": batch,
                                 "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                torch.cuda.empty_cache()
        for backend in backends:  # attention share of a decode step with the full history (eager, profiled)
            try:
                engine = Engine(config, weights, backend=backend, page_size=16, max_model_len=args.prompt + 64,
                                max_batch_tokens=8192, max_running=batch)
                g = torch.Generator().manual_seed(4)
                for _ in range(batch):
                    engine.add(torch.randint(0, config.vocab_size, (args.prompt,), generator=g).tolist(), 40)
                while engine.stats.decode_steps < 2:
                    engine.step()
                share = attention_share(engine)
                for r in rows:
                    if r["batch"] == batch and r["backend"] == backend:
                        r.update(share)
                del engine
            except Exception as exc:  # noqa: BLE001
                print(f"attention share ({backend}, batch {batch}) failed: {exc}", file=sys.stderr)
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "layers": args.layers, "prompt": args.prompt, "gen": args.gen,
            "date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/model.py " + " ".join(argv or sys.argv[1:])}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"model: Llama-3-8B shapes, {args.layers} layers, bf16, prompt {args.prompt}, gen {args.gen}")
    print(f"{'batch':>5} {'backend':>10} {'graphs':>6} {'decode tok/s':>12} {'step ms':>8} {'e2e tok/s':>10} "
          f"{'attn share':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['batch']:>5} {r['backend']:>10} {r['graphs']!s:>6} {r['error'][:60]}")
            continue
        share = r.get("attention_share")
        print(f"{r['batch']:>5} {r['backend']:>10} {r['graphs']!s:>6} {r['decode_tok_s']:>12.0f} "
              f"{r['decode_step_ms']:>8.2f} {r['e2e_tok_s']:>10.0f} {'' if share is None else f'{share:.1%}':>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
