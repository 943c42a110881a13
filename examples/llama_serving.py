"""Serve a Llama-style model through attnjit: continuous batching over a paged KV cache, chunked prefill mixed with
decode, CUDA-graph decode buckets, and (optionally) a check against Hugging Face transformers.

    python examples/llama_serving.py                      # tiny model, 6 requests arriving over time
    python examples/llama_serving.py --check-hf           # same, compared step by step with LlamaForCausalLM
    python examples/llama_serving.py --graphs             # decode steps replay CUDA graphs
    python examples/llama_serving.py --backend flashinfer # FlashInfer's wrappers at the same call sites
    ATTNJIT_LOG=run.jsonl python examples/llama_serving.py   # record every dispatch (see README)

With no GPU it runs the float64 reference backend on the CPU (slow, same plumbing). Weights are random (seeded):
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from attnjit.models import Engine, LlamaConfig, LlamaWeights, transformers_logits

# (prompt length, tokens to generate, arrival step): requests join while others decode and leave at different steps
WORKLOAD = [(37, 12, 0), (5, 20, 0), (130, 8, 1), (1, 16, 3), (64, 10, 6), (300, 6, 9)]


def compare_with_hf(config: LlamaConfig, weights: LlamaWeights, engine: Engine, requests, device) -> dict:
    """Teacher-forced check: transformers' logits for each request's prompt + generated tokens, position by
    position, against the logits the engine produced at each step. Greedy tokens are equal exactly when
    transformers' argmax at every position is the engine's token."""
    ref_logits = transformers_logits(config, weights, requests, device)
    worst_abs, worst_rel, min_margin, mismatches = 0.0, 0.0, float("inf"), []
    for r in requests:
        ref = ref_logits[r.id]
        ours = torch.stack(engine.logits[r.id]).double()
        worst_abs = max(worst_abs, (ours - ref).abs().max().item())
        worst_rel = max(worst_rel, ((ours - ref).norm() / ref.norm()).item())
        top2 = ref.topk(2, dim=-1).values
        min_margin = min(min_margin, (top2[:, 0] - top2[:, 1]).min().item())
        hf_tokens = ref.argmax(dim=-1).tolist()
        if hf_tokens != r.generated:
            mismatches.append({"request": r.id, "engine": r.generated, "transformers": hf_tokens})
    return {"max_abs_logit_diff": worst_abs, "max_rel_logit_diff": worst_rel, "min_top2_margin": min_margin,
            "token_mismatches": mismatches}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=None, choices=["attnjit", "flashinfer", "reference"],
                    help="attention backend (default: attnjit on a GPU, reference on a CPU)")
    ap.add_argument("--graphs", action="store_true", help="replay CUDA graphs for decode-only steps")
    ap.add_argument("--check-hf", action="store_true", help="compare with transformers' LlamaForCausalLM (float32)")
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                    help="model dtype (default bf16; fp32 with --check-hf, attention then in fp16)")
    ap.add_argument("--max-batch-tokens", type=int, default=128, help="token budget per step (chunked prefill)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    backend = args.backend or ("attnjit" if on_gpu else "reference")
    if backend != "reference" and not on_gpu:
        ap.error(f"backend {backend!r} needs a CUDA GPU; use --backend reference on a CPU")
    dtype_name = args.dtype or ("fp32" if args.check_hf else "bf16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    attn_dtype = torch.float16 if dtype == torch.float32 else dtype

    config = LlamaConfig.tiny()
    weights = LlamaWeights.random(config, dtype=dtype, device=device, seed=args.seed)
    engine = Engine(config, weights, backend=backend, device=device, dtype=dtype, attn_dtype=attn_dtype,
                    page_size=16, num_pages=30, max_model_len=512, max_batch_tokens=args.max_batch_tokens,
                    max_running=4, cuda_graphs=args.graphs, keep_logits=args.check_hf, check_pages=True)
    g = torch.Generator().manual_seed(args.seed + 1)
    requests = [engine.add(torch.randint(0, config.vocab_size, (n,), generator=g).tolist(), m, arrival=a)
                for n, m, a in WORKLOAD]
    t0 = time.perf_counter()
    engine.run()
    elapsed = time.perf_counter() - t0
    s = engine.stats
    print(f"backend {backend}, {dtype_name} model ({attn_dtype} attention), graphs {'on' if args.graphs else 'off'}: "
          f"{len(requests)} requests in {s.steps} steps ({s.mixed_steps} mixed/prefill, {s.decode_steps} decode, "
          f"{s.graph_replays} graph replays), {elapsed:.2f} s; pages reused {engine.alloc.reuses} times, "
          f"{engine.alloc.num_used} still in use")
    for r in requests:
        print(f"  request {r.id}: prompt {len(r.prompt):4d}, arrived step {r.arrival}, finished step "
              f"{r.finished_step}: {r.generated}")
    result = {"backend": backend, "dtype": dtype_name, "graphs": args.graphs, "stats": vars(s),
              "requests": [{"id": r.id, "prompt_len": len(r.prompt), "generated": r.generated} for r in requests]}
    rc = 0
    if args.check_hf:
        check = compare_with_hf(config, weights, engine, requests, device)
        result["check_hf"] = check
        ok = not check["token_mismatches"]
        print(f"transformers check: tokens {'equal' if ok else 'DIFFER'}; max |logit diff| "
              f"{check['max_abs_logit_diff']:.2e}, max relative {check['max_rel_logit_diff']:.2e} (smallest top-2 "
              f"margin {check['min_top2_margin']:.2e})")
        rc = 0 if ok else 1
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
