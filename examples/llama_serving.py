"""Serve a Llama-style model through attnjit: continuous batching over a paged KV cache, chunked prefill mixed with
decode, CUDA-graph decode buckets, and (optionally) a check against Hugging Face transformers.

    python examples/llama_serving.py                      # tiny model, 6 requests arriving over time
    python examples/llama_serving.py --check-hf           # same, compared step by step with LlamaForCausalLM
    python examples/llama_serving.py --graphs             # decode steps replay CUDA graphs
    python examples/llama_serving.py --backend flashinfer # FlashInfer's wrappers at the same call sites
    python examples/llama_serving.py --context-parallel 2 # KV pages sharded over 2 ranks (attnjit.distributed)
    ATTNJIT_LOG=run.jsonl python examples/llama_serving.py   # record every dispatch (see README)

With no GPU it runs the float64 reference backend on the CPU (slow, same plumbing). Weights are random (seeded):
nothing is downloaded.

``--context-parallel N`` spawns N ranks (torch.distributed: NCCL on N GPUs, gloo on the CPU) that each run the same
scheduler and model, hold every request's KV pages p with p % N == rank, and merge the attention states with one
all-gather per layer (docs/context-parallel.md). The ranks must agree on every token; rank 0 reports.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from attnjit.distributed import METHODS  # noqa: E402
from attnjit.models import Engine, LlamaConfig, LlamaWeights, transformers_logits  # noqa: E402

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
    ap.add_argument("--context-parallel", type=int, default=1, metavar="N",
                    help="shard the KV pages over N ranks (spawned processes; N GPUs, or gloo on the CPU)")
    ap.add_argument("--cp-combine", default="all_gather", choices=METHODS,
                    help="how the ranks' attention states are combined (with --context-parallel)")
    args = ap.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    backend = args.backend or ("attnjit" if on_gpu else "reference")
    if backend != "reference" and not on_gpu:
        ap.error(f"backend {backend!r} needs a CUDA GPU; use --backend reference on a CPU")
    world = args.context_parallel
    if world < 1:
        ap.error(f"--context-parallel must be >= 1, got {world}")
    if world > 1 and backend == "flashinfer":
        ap.error("--context-parallel runs attnjit (GPU) or the reference (CPU) on each shard, not flashinfer")
    if world > 1 and on_gpu and torch.cuda.device_count() < world:
        ap.error(f"--context-parallel {world} needs {world} GPUs; this host has {torch.cuda.device_count()}")
    if world == 1:
        result, rc = serve(args, backend, device="cuda" if on_gpu else "cpu")
    else:
        import tempfile

        from attnjit.distributed import launch
        with tempfile.TemporaryDirectory(prefix="llama-cp-") as tmp:
            out = Path(tmp) / "rank0.json"
            launch(_cp_rank, world, vars(args), backend, str(out), backend="nccl" if on_gpu else "gloo")
            result = json.loads(out.read_text())
        rc = result.pop("rc")
        _report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return rc


def _cp_rank(rank: int, world: int, arg_dict: dict, backend: str, out: str) -> None:
    """One rank of --context-parallel: the same run with context-parallel attention; rank 0 writes the result."""
    import torch.distributed as dist

    from attnjit.distributed import context_parallel_ops

    args = argparse.Namespace(**arg_dict)
    on_gpu = torch.cuda.is_available()
    ops = context_parallel_ops(backend, combine=args.cp_combine)  # main() allows attnjit (GPU) or reference
    result, rc = serve(args, backend, device=f"cuda:{rank}" if on_gpu else "cpu", ops=ops, quiet=True)
    every = [None] * world
    dist.all_gather_object(every, [r["generated"] for r in result["requests"]])
    if any(tokens != every[0] for tokens in every):
        raise RuntimeError(f"rank {rank}: the ranks generated different tokens: {every}")
    if rank == 0:
        result["context_parallel"] = {"ranks": world, "combine": args.cp_combine}
        Path(out).write_text(json.dumps({**result, "rc": rc}, default=str))


def serve(args, backend: str, *, device: str, ops=None, quiet: bool = False) -> tuple[dict, int]:
    """Run the workload once; returns (the result record, exit status) and prints the report unless quiet."""
    dtype_name = args.dtype or ("fp32" if args.check_hf else "bf16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    attn_dtype = torch.float16 if dtype == torch.float32 else dtype

    config = LlamaConfig.tiny()
    weights = LlamaWeights.random(config, dtype=dtype, device=device, seed=args.seed)
    engine = Engine(config, weights, backend=backend, device=device, dtype=dtype, attn_dtype=attn_dtype,
                    page_size=16, num_pages=30, max_model_len=512, max_batch_tokens=args.max_batch_tokens,
                    max_running=4, cuda_graphs=args.graphs, keep_logits=args.check_hf, check_pages=True, ops=ops)
    g = torch.Generator().manual_seed(args.seed + 1)
    requests = [engine.add(torch.randint(0, config.vocab_size, (n,), generator=g).tolist(), m, arrival=a)
                for n, m, a in WORKLOAD]
    t0 = time.perf_counter()
    engine.run()
    elapsed = time.perf_counter() - t0
    s = engine.stats
    result = {"backend": backend, "dtype": dtype_name, "attn_dtype": str(attn_dtype), "graphs": args.graphs,
              "elapsed_s": elapsed, "pages_reused": engine.alloc.reuses, "pages_in_use": engine.alloc.num_used,
              "stats": vars(s),
              "requests": [{"id": r.id, "prompt_len": len(r.prompt), "arrival": r.arrival,
                            "finished_step": r.finished_step, "generated": r.generated} for r in requests]}
    rc = 0
    if args.check_hf:
        check = compare_with_hf(config, weights, engine, requests, device)
        result["check_hf"] = check
        rc = 0 if not check["token_mismatches"] else 1
    if not quiet:
        _report(result)
    return result, rc


def _report(result: dict) -> None:
    s = result["stats"]
    cp = result.get("context_parallel")
    print(f"backend {result['backend']}, {result['dtype']} model ({result['attn_dtype']} attention), graphs "
          f"{'on' if result['graphs'] else 'off'}"
          + (f", context-parallel over {cp['ranks']} ranks ({cp['combine']})" if cp else "")
          + f": {len(result['requests'])} requests in {s['steps']} steps ({s['mixed_steps']} mixed/prefill, "
          f"{s['decode_steps']} decode, {s['graph_replays']} graph replays), {result['elapsed_s']:.2f} s; pages "
          f"reused {result['pages_reused']} times, {result['pages_in_use']} still in use")
    for r in result["requests"]:
        print(f"  request {r['id']}: prompt {r['prompt_len']:4d}, arrived step {r['arrival']}, finished step "
              f"{r['finished_step']}: {r['generated']}")
    check = result.get("check_hf")
    if check:
        ok = not check["token_mismatches"]
        print(f"transformers check: tokens {'equal' if ok else 'DIFFER'}; max |logit diff| "
              f"{check['max_abs_logit_diff']:.2e}, max relative {check['max_rel_logit_diff']:.2e} (smallest top-2 "
              f"margin {check['min_top2_margin']:.2e})")


if __name__ == "__main__":
    sys.exit(main())
