"""The causal rule on one rank's shard, in global positions: as a kernel variant and as a reference mask.

Causal is bottom-right aligned over the whole request: query row i of Q sees key g iff ``g <= K - Q + i`` (K the
global KV length). A rank's local call has L keys at global positions ``g(j)`` (sharding.global_key_positions), and
a kernel's query position is local: ``q_pos = L - Q + i``. So the rule on the shard is

    g(j) <= q_pos + (K - L)          (K - L = ShardTable.q_shift, one int per request)

A stock causal kernel would apply ``j <= q_pos`` instead, which is right only where the shard's keys are a
contiguous global range ending at K. Round-robin pages are not, so a shard's causal prefill runs non-causal with
the ``cp_causal`` logits mask below (decode needs no mask: its one query sees every key). A row that sees no key
of the shard comes out of the kernel as the empty state (0, lse = -inf), the identity of the merge.
"""

from __future__ import annotations

import torch

from .. import reference
from ..variants import TensorParam, Variant
from .sharding import ShardTable, global_key_positions

CP_CAUSAL = Variant(
    "cp_causal",
    params={"cp_world": int, "cp_rank": int, "cp_page_size": int,
            "cp_q_shift": TensorParam("int32", per="request")},
    logits_mask="""const int page = kv_pos / cp_page_size;
const int g = (page * cp_world + cp_rank) * cp_page_size + (kv_pos - page * cp_page_size);
return g <= q_pos + cp_q_shift[batch_idx];""")


def variant_params(table: ShardTable, q_shift: torch.Tensor) -> dict:
    """run()'s arguments of CP_CAUSAL for ``table``; q_shift: int32 [B] on the kernel's device."""
    return {"cp_world": table.world, "cp_rank": table.rank, "cp_page_size": table.page_size, "cp_q_shift": q_shift}


def reference_hooks(table: ShardTable) -> reference.Hooks:
    """The same rule for attnjit.reference.batch_paged (positions are the local ones the kernel sees)."""
    shift = table.q_shift.tolist()

    def mask(p: reference.Positions) -> torch.Tensor:
        g = global_key_positions(p.kv_pos, page_size=table.page_size, world=table.world, rank=table.rank)
        return (g[None, :] <= (p.q_pos + shift[p.batch_idx])[:, None])[None]   # [1, Q, L]

    return reference.Hooks(mask=mask)
