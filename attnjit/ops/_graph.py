"""Graph mode (use_cuda_graph=True): what a captured run() replays, and what a later plan() must keep for the
replay to stay correct.

A replay launches the captured kernel with the captured parameter struct (passed by value: every scalar and
pointer as they were at capture) over whatever work list the fixed metadata buffers hold by then. A re-plan rewrites
only those buffers, so it must fit the captured operands (no more query rows than the captured q and out, no more
KV rows than a captured ragged k and v, no page past the captured cache) and leave every other field of the struct
as it was (heads, sm_scale, a variant's values and tensors). Each rule is checked before plan() writes anything.
"""

from __future__ import annotations

from typing import Any


class Replay:
    """The operands a wrapper's replays read and write: those of the last run() captured into a graph, else (no
    capture yet) of the last run(), since an engine warms up eagerly and then captures."""

    def __init__(self) -> None:
        self.num_pages: int | None = None   # pages of the paged cache
        self.q_rows: int | None = None      # rows of q, out and lse
        self.kv_rows: int | None = None     # rows of a ragged k and v
        self.captured = False

    def note_run(self, capturing: bool, q_rows: int, kv_rows: int, paged: bool) -> None:
        """A run() in graph mode: ``kv_rows`` is the cache's pages (paged) or k's rows (ragged)."""
        if capturing or not self.captured:
            self.captured = self.captured or capturing
            self.q_rows = q_rows
            if paged:
                self.num_pages, self.kv_rows = kv_rows, None
            else:
                self.num_pages, self.kv_rows = None, kv_rows

    def check_batch(self, total_q: int, total_kv: int, max_page: int, paged: bool) -> None:
        """A new plan's sizes against what a replay reads and writes."""
        what = "captured" if self.captured else "last"
        if self.q_rows is not None and total_q > self.q_rows:
            raise ValueError(f"use_cuda_graph: this plan has {total_q} query rows but q and out of the {what} run() "
                             f"(what a replay reads and writes) have {self.q_rows}; plan and capture with the "
                             "largest batch first, or use one wrapper per size")
        if not paged and self.kv_rows is not None and total_kv > self.kv_rows:
            raise ValueError(f"use_cuda_graph: this plan has {total_kv} KV rows but k and v of the {what} run() "
                             f"(what a replay reads) have {self.kv_rows}")
        if paged and self.num_pages is not None and max_page >= self.num_pages:
            raise ValueError(f"use_cuda_graph: the page table uses page id {max_page} but the cache of the {what} "
                             f"run() (what a replay reads) has {self.num_pages} pages")


def check_launch(graph_values: list[Any], values: list[Any], names: tuple[str, ...], metadata: set[int]) -> None:
    """A re-plan's parameter struct against the captured plan's: equal in every field but the metadata pointers
    (``metadata``: indices of the fixed buffers' fields, the same buffers in graph mode). A replay passes the
    captured struct, so a field that changed would be silently ignored."""
    for i, (old, new) in enumerate(zip(graph_values, values)):
        if i not in metadata and old != new:
            raise ValueError(f"use_cuda_graph: this plan sets the kernel parameter {names[i]} to {new!r}, the plan "
                             f"the graph was captured with to {old!r}; a replay passes the captured parameters, so "
                             "the options, heads, sm_scale and variant values (and tensors) of plan() must stay "
                             "those of the first plan: use one wrapper per setting")
