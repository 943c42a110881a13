"""Continuous batching: each step mixes the decode tokens of running requests with chunks of new prompts.

Per step the scheduler spends a token budget (``max_batch_tokens``): one token for every running request that is
decoding, then the next chunk of each request still in its prompt, then new requests as they arrive (chunked
prefill: a long prompt takes several steps). A request finishes after ``max_new_tokens`` tokens (or its EOS), and
its pages go back to the allocator at once, so the next request reuses them.

Pages are allocated as a sequence grows, but a request is admitted only when the pages it can ever need (prompt +
max_new_tokens - 1 tokens of KV) fit beside what the running requests can still claim, so a running request never
runs out of pages mid-flight and nothing has to be preempted.

The step's metadata follows the seed's contracts (FlashInfer's): ``qo_indptr`` over the step's query tokens,
``kv_indptr``/``kv_indices``/``kv_last_page_len`` over each request's pages *after* this step's tokens are
appended, and per token its request (``batch_indices``) and KV position (``positions``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .paging import PageAllocator


@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0                 # first step at which the scheduler may admit it
    eos_token_id: int | None = None
    generated: list[int] = field(default_factory=list)
    num_computed: int = 0            # tokens whose K/V are in the cache
    state: str = "waiting"           # waiting | running | finished
    finished_step: int | None = None

    @property
    def max_kv(self) -> int:
        """KV tokens this request can ever hold: its prompt and every generated token but the last."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def in_prompt(self) -> bool:
        return self.num_computed < len(self.prompt)


@dataclass
class Item:
    """One request's share of a step: ``tokens`` at KV positions start .. start + len(tokens) - 1."""

    request: Request
    start: int
    tokens: list[int]
    emits: bool                      # its last row's logits give the request's next token


@dataclass
class StepBatch:
    step: int
    items: list[Item]
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    kv_last_page_len: list[int]
    token_ids: list[int]             # [nnz] the step's input tokens, request by request
    positions: list[int]             # [nnz] each token's KV position (= its RoPE position)
    batch_indices: list[int]         # [nnz] each token's request index within the step
    logit_rows: list[int]            # rows of the emitting items' last tokens, in item order

    @property
    def batch_size(self) -> int:
        return len(self.items)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_only(self) -> bool:
        """Every request has exactly one query row (the decode wrapper and CUDA graphs apply)."""
        return all(len(it.tokens) == 1 for it in self.items)

    @property
    def kv_lens(self) -> list[int]:
        return [it.start + len(it.tokens) for it in self.items]


class Scheduler:
    def __init__(self, allocator: PageAllocator, *, max_batch_tokens: int = 512, max_running: int = 64,
                 max_model_len: int | None = None):
        if max_batch_tokens < 1 or max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be positive")
        self.alloc = allocator
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.step_index = 0

    def add(self, request: Request) -> None:
        if not request.prompt:
            raise ValueError(f"request {request.id}: empty prompt")
        if request.max_new_tokens < 1:
            raise ValueError(f"request {request.id}: max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if self.max_model_len is not None and request.max_kv + 1 > self.max_model_len:
            raise ValueError(f"request {request.id}: prompt {len(request.prompt)} + max_new_tokens "
                             f"{request.max_new_tokens} exceeds max_model_len={self.max_model_len}")
        pages = self.alloc.pages_for(request.max_kv)
        if pages > self.alloc.num_pages - self.alloc.reserved:
            raise ValueError(f"request {request.id} can need {pages} pages; the cache has only "
                             f"{self.alloc.num_pages - self.alloc.reserved}")
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _claimable(self) -> int:
        """Pages the running requests may still allocate before they finish."""
        return sum(self.alloc.pages_for(r.max_kv) - len(self.alloc.pages(r.id)) for r in self.running)

    def schedule(self) -> StepBatch | None:
        """The next step's batch (None when nothing can run now: no work, or every waiting request arrives
        later). Allocates the pages the step's tokens need."""
        step = self.step_index
        budget = self.max_batch_tokens
        chosen: dict[int, Item] = {}                             # running index -> item
        for i, r in enumerate(self.running):                     # decodes get the budget first: one token each
            if not r.in_prompt and budget > 0:
                chosen[i] = Item(r, r.num_computed, [r.generated[-1]], True)
                budget -= 1
        for i, r in enumerate(self.running):                     # then the prompts already started
            if r.in_prompt and budget > 0:
                chosen[i] = self._chunk(r, budget)
                budget -= len(chosen[i].tokens)
        items = [chosen[i] for i in sorted(chosen)]              # batch order = admission order
        while budget > 0 and self.waiting and len(self.running) < self.max_running:
            r = next((w for w in self.waiting if w.arrival <= step), None)
            if r is None:
                break
            if self.alloc.num_free - self._claimable() < self.alloc.pages_for(r.max_kv):
                break                                            # FIFO: wait until finishing requests free pages
            self.waiting.remove(r)
            r.state = "running"
            self.running.append(r)
            items.append(self._chunk(r, budget))
            budget -= len(items[-1].tokens)
        if not items:
            return None
        for it in items:
            self.alloc.ensure(it.request.id, it.start + len(it.tokens))
        return self._batch(step, items)

    @staticmethod
    def _chunk(r: Request, budget: int) -> Item:
        n = min(len(r.prompt) - r.num_computed, budget)
        start = r.num_computed
        return Item(r, start, r.prompt[start:start + n], start + n == len(r.prompt))

    def _batch(self, step: int, items: list[Item]) -> StepBatch:
        ps = self.alloc.page_size
        qo, kvp, idx, last, toks, pos, bidx, rows = [0], [0], [], [], [], [], [], []
        for b, it in enumerate(items):
            n = len(it.tokens)
            kv_len = it.start + n
            pages = self.alloc.table(it.request.id)   # ensure() sized it for exactly kv_len tokens
            idx += pages
            kvp.append(kvp[-1] + len(pages))
            last.append(kv_len - (len(pages) - 1) * ps)
            toks += it.tokens
            pos += range(it.start, kv_len)
            bidx += [b] * n
            qo.append(qo[-1] + n)
            if it.emits:
                rows.append(qo[-1] - 1)
        return StepBatch(step=step, items=items, qo_indptr=qo, kv_indptr=kvp, kv_indices=idx, kv_last_page_len=last,
                         token_ids=toks, positions=pos, batch_indices=bidx, logit_rows=rows)

    def commit(self, batch: StepBatch, next_tokens: list[int]) -> list[Request]:
        """Advance the step's requests; ``next_tokens`` holds one token per emitting item (item order). Returns
        the requests that finished in this step (their pages are free again)."""
        emitting = [it for it in batch.items if it.emits]
        if len(next_tokens) != len(emitting):
            raise ValueError(f"commit: {len(emitting)} items emit a token, got {len(next_tokens)} tokens")
        done = []
        tokens = iter(next_tokens)
        for it in batch.items:
            r = it.request
            r.num_computed = it.start + len(it.tokens)
            if not it.emits:
                continue
            tok = int(next(tokens))
            r.generated.append(tok)
            if len(r.generated) >= r.max_new_tokens or (r.eos_token_id is not None and tok == r.eos_token_id):
                r.state = "finished"
                r.finished_step = batch.step
                self.alloc.free(r.id)
                self.running.remove(r)
                self.finished.append(r)
                done.append(r)
        self.step_index += 1
        return done

    def idle_step(self) -> None:
        """Advance the clock when nothing could run (every waiting request arrives later)."""
        self.step_index += 1
