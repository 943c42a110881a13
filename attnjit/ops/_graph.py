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
    """What a wrapper's replays read and write: the operands of the runs captured into graphs (the smallest of each,
    since every captured graph replays the current plan). Before any capture only the cache's pages of the last
    run() count (the page bound fast_plan() checks against): there is no replay to keep within rows yet, and an
    eager run() checks q, out and k/v against its own plan."""

    def __init__(self) -> None:
        self.num_pages: int | None = None   # pages of the paged cache
        self.q_rows: int | None = None      # rows of q, out and lse (captured runs only)
        self.kv_rows: int | None = None     # rows of a ragged k and v (captured runs only)
        self.captured = False

    def note_run(self, capturing: bool, q_rows: int, kv_rows: int, paged: bool) -> None:
        """A run() in graph mode: ``kv_rows`` is the cache's pages (paged) or the fewer of k's and v's rows
        (ragged)."""
        if capturing:
            first = not self.captured
            self.captured = True
            self.q_rows = q_rows if first else min(self.q_rows, q_rows)
            if paged:
                self.num_pages = kv_rows if first or self.num_pages is None else min(self.num_pages, kv_rows)
            else:
                self.kv_rows = kv_rows if first or self.kv_rows is None else min(self.kv_rows, kv_rows)
        elif not self.captured and paged:
            self.num_pages = kv_rows

    def check_batch(self, total_q: int, total_kv: int, max_page: int, paged: bool) -> None:
        """A new plan's sizes against what a replay reads and writes."""
        if self.q_rows is not None and total_q > self.q_rows:
            raise ValueError(f"use_cuda_graph: this plan has {total_q} query rows but q and out of the captured run() "
                             f"(what a replay reads and writes) have {self.q_rows}; plan and capture with the "
                             "largest batch first, or use one wrapper per size")
        if not paged and self.kv_rows is not None and total_kv > self.kv_rows:
            raise ValueError(f"use_cuda_graph: this plan has {total_kv} KV rows but k and v of the captured run() "
                             f"(what a replay reads) have {self.kv_rows}")
        if paged and self.num_pages is not None and max_page >= self.num_pages:
            what = "captured" if self.captured else "last"
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
