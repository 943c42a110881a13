"""Context-parallel attention over torch.distributed: every rank holds a shard of every request's KV pages, runs
attention on its shard with return_lse, and the ranks' (o, lse) states are merged with one collective.

Sharding (sharding.py): round-robin pages. Logical page p of a request (its p-th page in ``paged_kv_indices``)
lives on rank ``p % world``. Chosen over contiguous chunks because a growing request stays balanced without moving
data: decode appends to the last page, whose owner changes every page_size tokens, so at every step each rank
holds within one page of K / world keys of every request, and a prefill chunk's new keys spread over the ranks too.
Contiguous chunks would need the final length up front or re-sharding as K grows. The split of the page table is
a pure function of the global table (``shard_page_table``), unit-tested without tensors. A table's page id names
the page in its owner's cache, so each rank's cache only holds the pages it owns (ids may overlap across ranks).

Causal (causal.py): the rule ``j <= K - Q + i`` is bottom-right aligned on the GLOBAL history. A rank's local key
j sits at global position ``g(j) = ((j // page_size) * world + rank) * page_size + j % page_size``, and the local
kernel's query position is ``q_pos = L - Q + i`` (L the local KV length), so on the shard the rule reads
``g(j) <= q_pos + (K - L)``. A round-robin shard is not one contiguous global range, so a shifted stock causal
kernel cannot express it; a causal prefill runs the local call non-causal with the ``cp_causal`` logits-mask
variant (rank, world, page_size and the per-request shift K - L as parameters), and the CPU path applies the same
rule as a reference mask. Decode needs no mask (its one query sees every key). A row that sees no key on a shard
(the shard's keys are all in its future, or the request has no page on this rank: a request shorter than world
pages) yields the empty state (0, lse = -inf), the identity of the merge. Requests without a page on a rank get
one dummy entry (the scratch page) so kernels keep a fixed batch shape, and their rows are set to the empty
state before the collective.

Combine (combine.py): ``"all_gather"`` (default; one collective of packed (o, lse), then merge_states, bitwise
equal on every rank) or ``"all_reduce"`` (MAX of lse then SUM of weighted o: the reduce of the merge).

Modules: sharding (the table split), causal (the rule), local (one rank's kernel or reference call), combine (the
collective and merge), attention (the plan/run wrappers), ops (what an engine swaps in), launch (spawn a group).
"""

from .attention import ContextParallelDecode, ContextParallelPrefill
from .causal import CP_CAUSAL
from .combine import METHODS, StateCombiner
from .launch import launch
from .ops import append_paged_kv_cache, context_parallel_ops
from .sharding import ShardTable, global_key_positions, shard_page_table, token_owner

__all__ = ["CP_CAUSAL", "METHODS", "ContextParallelDecode", "ContextParallelPrefill", "ShardTable", "StateCombiner",
           "append_paged_kv_cache", "context_parallel_ops", "global_key_positions", "launch", "shard_page_table",
           "token_owner"]
