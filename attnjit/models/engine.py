"""A small serving engine: continuous batching over PagedLlama, plan() once per step, run() per layer.

Each step the scheduler picks the batch (decodes + prompt chunks), the engine uploads the step's metadata in one
host-to-device copy, plans one wrapper, and runs the model:

- a step with any prompt chunk runs the prefill wrapper (causal, bottom-right aligned: a decode row in the same
  batch sees its whole history), eagerly;
- a decode-only step runs the decode wrapper, eagerly, or with ``cuda_graphs=True`` by replaying the CUDA graph
  captured once for the smallest batch-size bucket that holds it. Padded slots of a bucket attend to one token in
  the reserved scratch page 0 and their logits are dropped. Per step a graph replay only re-plans (new lengths
  and page tables in the same fixed buffers) and replays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .backends import FAST_REPLAN, HOST_PAGE_IDS, load_ops
from .llama import AttnMetadata, LlamaConfig, LlamaWeights, PagedLlama
from .paging import PageAllocator
from .scheduler import Request, Scheduler, StepBatch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
WORKSPACE_BYTES = 128 << 20


@dataclass
class EngineStats:
    steps: int = 0
    mixed_steps: int = 0
    decode_steps: int = 0
    graph_replays: int = 0
    fast_replans: int = 0       # graph replays re-planned with the wrapper's fast_plan() (not plan())
    tokens_in: int = 0          # query tokens processed (prompt + decode)
    tokens_out: int = 0         # tokens generated
    decode_time_s: float = 0.0  # wall time of decode-only steps (synchronized)
    decode_tokens: int = 0
    total_time_s: float = 0.0
    buckets: dict[int, int] = field(default_factory=dict)


class _DecodeGraph:
    """One batch-size bucket: fixed metadata buffers, a graph-mode decode wrapper, the captured model step."""

    def __init__(self, engine: Engine, size: int):
        self.size = size
        e = engine
        dev = e.device
        cap = size * e.max_pages_per_seq
        # one int32 buffer: tokens [b] | positions [b] | kv_indptr [b+1] | last_page_len [b] | kv_indices [cap]
        self.buf = torch.zeros(4 * size + 1 + cap, dtype=torch.int32, device=dev)
        self.host = torch.zeros(self.buf.numel(), dtype=torch.int32, pin_memory=True)
        b = size
        self.tokens, self.positions = self.buf[:b], self.buf[b:2 * b]
        self.kv_indptr, self.last = self.buf[2 * b:3 * b + 1], self.buf[3 * b + 1:4 * b + 1]
        self.kv_indices = self.buf[4 * b + 1:]
        self.host_kv_indptr, self.host_last = self.host[2 * b:3 * b + 1], self.host[3 * b + 1:4 * b + 1]
        self.host_kv_indices = self.host[4 * b + 1:]
        self.batch_indices = torch.arange(b, dtype=torch.int32, device=dev)
        self.meta = AttnMetadata(batch_indices=self.batch_indices, positions=self.positions, kv_indptr=self.kv_indptr,
                                 kv_indices=self.kv_indices, kv_last_page_len=self.last)
        self.wrapper = e.ops.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "NHD", use_cuda_graph=True,
            use_tensor_cores=True, paged_kv_indptr_buffer=self.kv_indptr, paged_kv_indices_buffer=self.kv_indices,
            paged_kv_last_page_len_buffer=self.last)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def fill(self, e: Engine, batch: StepBatch | None) -> None:
        """Write the step's metadata (padded to the bucket) into the fixed buffers and re-plan."""
        b = self.size
        n = batch.batch_size if batch else 0
        toks = (batch.token_ids if batch else []) + [0] * (b - n)
        pos = (batch.positions if batch else []) + [0] * (b - n)
        kvp = list(batch.kv_indptr) if batch else [0]
        idx = list(batch.kv_indices) if batch else []
        last = (batch.kv_last_page_len if batch else []) + [1] * (b - n)
        for _ in range(b - n):           # padded slot: one token in the scratch page 0
            idx.append(0)
            kvp.append(kvp[-1] + 1)
        vals = toks + pos + kvp + last + idx           # the buffer's layout, in order
        self.host[:len(vals)] = torch.tensor(vals, dtype=torch.int32)
        self.buf[:len(vals)].copy_(self.host[:len(vals)], non_blocking=True)
        # plan() reads the indptr arrays from the host copy (no device-to-host copy), and the page ids too where the
        # backend takes them from the host without a synchronization (engine.host_page_ids)
        ids = e.page_ids(self.kv_indices, self.host_kv_indices)[:len(idx)]
        if e.fast_replan and self.graph is not None:  # captured: only lengths and page tables change
            self.wrapper.fast_plan(self.host_kv_indptr, ids, self.host_last)
            e.stats.fast_replans += 1
        else:
            e.plan_decode(self.wrapper, self.host_kv_indptr, ids, self.host_last)

    def capture(self, e: Engine) -> None:
        self.fill(e, None)
        side = torch.cuda.Stream(e.device)
        side.wait_stream(torch.cuda.current_stream(e.device))
        with torch.cuda.stream(side):    # warm-up outside the capture (allocator, lazy init)
            e.model.forward(self.tokens, self.meta, self.wrapper, None)
        torch.cuda.current_stream(e.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=e.graph_pool):
            self.logits = e.model.forward(self.tokens, self.meta, self.wrapper, None)

    def replay(self, e: Engine, batch: StepBatch) -> torch.Tensor:
        self.fill(e, batch)
        self.graph.replay()
        return self.logits[:batch.batch_size]


class Engine:
    """Continuous-batching generation over a paged KV cache with one of the attention backends."""

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, *, backend: str = "attnjit", page_size: int = 16,
                 num_pages: int | None = None, max_model_len: int = 4096, max_batch_tokens: int = 512,
                 max_running: int = 64, dtype: torch.dtype = torch.bfloat16, attn_dtype: torch.dtype | None = None,
                 device="cuda", cuda_graphs: bool = False, graph_buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 keep_logits: bool = False, check_pages: bool = False, ops=None):
        """``ops``: a namespace of the three attention names to use instead of ``load_ops(backend)`` (e.g.
        ``attnjit.distributed.context_parallel_ops(...)``, whose wrappers shard the KV pages over a process group)."""
        self.config = config
        self.device = torch.device(device)
        self.backend = backend
        self.ops = ops if ops is not None else load_ops(backend)
        # plan() gets the page ids from the host where the backend reads them there without a synchronization
        self.host_page_ids = ops is None and backend in HOST_PAGE_IDS
        self.fast_replan = ops is None and backend in FAST_REPLAN  # graph buckets re-plan with fast_plan()
        self.page_size = page_size
        self.max_pages_per_seq = -(-max_model_len // page_size)
        if num_pages is None:
            num_pages = 1 + max_running * self.max_pages_per_seq
        self.alloc = PageAllocator(num_pages, page_size, reserved=1)
        self.scheduler = Scheduler(self.alloc, max_batch_tokens=max_batch_tokens, max_running=max_running,
                                   max_model_len=max_model_len)
        self.model = PagedLlama(config, weights, ops=self.ops, num_pages=num_pages, page_size=page_size, dtype=dtype,
                                attn_dtype=attn_dtype, device=self.device)
        self.attn_dtype = self.model.attn_dtype
        on_gpu = self.device.type == "cuda"
        ws = lambda: torch.empty(WORKSPACE_BYTES if on_gpu else 1, dtype=torch.uint8, device=self.device)
        self.prefill = self.ops.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD", backend="fa2")
        self.decode = self.ops.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True)
        self.cuda_graphs = cuda_graphs
        if cuda_graphs and not on_gpu:
            raise ValueError("cuda_graphs=True needs a CUDA device")
        self.buckets = tuple(sorted(b for b in graph_buckets if b <= max_running)) or (max_running,)
        if self.buckets[-1] < max_running:
            self.buckets += (max_running,)
        self.graphs: dict[int, _DecodeGraph] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self.keep_logits = keep_logits
        self.logits: dict[int, list[torch.Tensor]] = {}    # request id -> logits of each generated token (CPU)
        self.check_pages = check_pages
        self.stats = EngineStats()
        self._next_id = 0

    # --- requests ------------------------------------------------------------------------------------------

    def add(self, prompt: list[int], max_new_tokens: int, *, arrival: int = 0, eos_token_id: int | None = None,
            request_id: int | None = None) -> Request:
        if any(not 0 <= t < self.config.vocab_size for t in prompt):
            raise ValueError(f"prompt holds token ids outside 0..{self.config.vocab_size - 1}")
        rid = self._next_id if request_id is None else request_id
        self._next_id = max(self._next_id, rid + 1)
        r = Request(id=rid, prompt=list(prompt), max_new_tokens=max_new_tokens, arrival=arrival,
                    eos_token_id=eos_token_id)
        self.scheduler.add(r)
        return r

    # --- planning --------------------------------------------------------------------------------------------

    def _plan_args(self) -> dict:
        return {"q_data_type": self.attn_dtype, "kv_data_type": self.attn_dtype}

    def plan_prefill(self, qo_indptr, kv_indptr, kv_indices, last) -> None:
        c = self.config
        self.prefill.plan(qo_indptr, kv_indptr, kv_indices, last, c.num_heads, c.num_kv_heads, c.head_dim,
                          self.page_size, causal=True, **self._plan_args())

    def page_ids(self, device_ids: torch.Tensor, host_ids: torch.Tensor) -> torch.Tensor:
        """The page ids plan() gets: the host copy where the backend reads them there (host_page_ids)."""
        return host_ids if self.host_page_ids else device_ids

    def plan_decode(self, wrapper, kv_indptr, kv_indices, last) -> None:
        c = self.config
        wrapper.plan(kv_indptr, kv_indices, last, c.num_heads, c.num_kv_heads, c.head_dim, self.page_size,
                     **self._plan_args())

    def _upload(self, batch: StepBatch) -> tuple[torch.Tensor, AttnMetadata, torch.Tensor, dict]:
        """One host-to-device copy of the step's int32 metadata; returns token ids, metadata and the logit rows
        (views into one device buffer), and the host copies of the indptr arrays for plan() (which
        then reads them without a device-to-host copy; FlashInfer takes host indptr too)."""
        parts = [batch.token_ids, batch.positions, batch.batch_indices, batch.qo_indptr, batch.kv_indptr,
                 batch.kv_last_page_len, batch.logit_rows, batch.kv_indices]
        flat = [x for p in parts for x in p]
        host = torch.tensor(flat, dtype=torch.int32)
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        bounds = [0]
        for p in parts:
            bounds.append(bounds[-1] + len(p))
        views = [dev[a:b] for a, b in zip(bounds, bounds[1:])]
        toks, pos, bidx, _, kvp, last, rows, idx = views
        meta = AttnMetadata(batch_indices=bidx, positions=pos, kv_indptr=kvp, kv_indices=idx, kv_last_page_len=last)
        host_views = {name: host[bounds[i]:bounds[i + 1]] for i, name in ((3, "qo_indptr"), (4, "kv_indptr"),
                                                                          (5, "last"), (7, "kv_indices"))}
        return toks, meta, rows, host_views

    # --- steps ---------------------------------------------------------------------------------------------

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def step(self) -> StepBatch | None:
        """Run one scheduler step; returns its batch (None when nothing was runnable: the clock advanced)."""
        batch = self.scheduler.schedule()
        if batch is None:
            self.scheduler.idle_step()
            return None
        t0 = time.perf_counter()
        if batch.decode_only and self.cuda_graphs:
            size = self._bucket(batch.batch_size)
            graph = self.graphs.get(size)
            if graph is None:
                graph = self.graphs[size] = _DecodeGraph(self, size)
                graph.capture(self)
            logits = graph.replay(self, batch)
            self.stats.graph_replays += 1
            self.stats.buckets[size] = self.stats.buckets.get(size, 0) + 1
        else:
            toks, meta, rows, h = self._upload(batch)
            if batch.decode_only:
                wrapper = self.decode
                self.plan_decode(wrapper, h["kv_indptr"], self.page_ids(meta.kv_indices, h["kv_indices"]), h["last"])
            else:
                wrapper = self.prefill
                self.plan_prefill(h["qo_indptr"], h["kv_indptr"], self.page_ids(meta.kv_indices, h["kv_indices"]), h["last"])
            logits = self.model.forward(toks, meta, wrapper, rows)
        next_tokens = logits.argmax(dim=-1).tolist()          # greedy; synchronizes
        dt = time.perf_counter() - t0
        if self.keep_logits:
            emitting = [it.request.id for it in batch.items if it.emits]
            host = logits.cpu()
            for rid, row in zip(emitting, host):
                self.logits.setdefault(rid, []).append(row)
        s = self.stats
        s.steps += 1
        s.tokens_in += batch.num_tokens
        s.tokens_out += len(next_tokens)
        if batch.decode_only:
            s.decode_steps += 1
            s.decode_time_s += dt
            s.decode_tokens += len(next_tokens)
        else:
            s.mixed_steps += 1
        self.scheduler.commit(batch, next_tokens)
        if self.check_pages:
            self.alloc.check()
        return batch

    def run(self, max_steps: int = 1_000_000) -> list[Request]:
        """Step until every request finished; returns them in the order they finished."""
        t0 = time.perf_counter()
        for _ in range(max_steps):
            if not self.scheduler.has_work:
                break
            self.step()
        else:
            raise RuntimeError(f"requests still running after {max_steps} steps")
        self.stats.total_time_s += time.perf_counter() - t0
        return list(self.scheduler.finished)
