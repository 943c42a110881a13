"""A page allocator for a paged KV cache: fixed-size pages handed to sequences and taken back when they finish.

Invariant (``check()``): every page is either on the free list or owned by exactly one sequence, never both and
never twice. Pages below ``reserved`` are never handed out (the engine uses page 0 as the scratch page that padded
CUDA-graph slots write into).
"""

from __future__ import annotations

from collections import deque


class OutOfPagesError(RuntimeError):
    """The allocator cannot hand out the pages asked for; nothing was allocated."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, *, reserved: int = 1):
        if type(num_pages) is not int or num_pages <= reserved:
            raise ValueError(f"num_pages must be an int larger than reserved={reserved}, got {num_pages!r}")
        if type(page_size) is not int or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.reserved = reserved
        self._free: deque[int] = deque(range(reserved, num_pages))   # FIFO: a freed page is reused last
        self._owner: dict[int, object] = {}                            # page -> sequence id
        self._pages: dict[object, list[int]] = {}                      # sequence id -> its pages, logical order
        self._ever_used: set[int] = set()
        self.reuses = 0   # allocations of a page that an earlier sequence had freed

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def pages(self, seq) -> list[int]:
        """The pages of ``seq`` in logical order (a copy)."""
        return list(self._pages.get(seq, ()))

    def table(self, seq) -> list[int]:
        """The live page list of ``seq`` (not a copy: read it, never change it)."""
        return self._pages[seq]

    def ensure(self, seq, num_tokens: int) -> list[int]:
        """Grow ``seq``'s page list so it holds ``num_tokens`` tokens; returns the newly allocated pages. Raises
        OutOfPagesError (allocating nothing) when the free list is too short."""
        have = self._pages.setdefault(seq, [])
        need = self.pages_for(num_tokens) - len(have)
        if need <= 0:
            return []
        if need > len(self._free):
            if not have:
                del self._pages[seq]
            raise OutOfPagesError(f"sequence {seq!r} needs {need} more pages for {num_tokens} tokens but only "
                                  f"{len(self._free)} of {self.num_pages - self.reserved} are free")
        new = [self._free.popleft() for _ in range(need)]
        for p in new:
            self._owner[p] = seq
            if p in self._ever_used:
                self.reuses += 1
            self._ever_used.add(p)
        have.extend(new)
        return new

    def free(self, seq) -> int:
        """Return all of ``seq``'s pages to the free list; returns how many. Freeing an unknown sequence is a
        KeyError (a double free is a bug in the caller)."""
        if seq not in self._pages:
            raise KeyError(f"sequence {seq!r} owns no pages (freed twice?)")
        pages = self._pages.pop(seq)
        for p in pages:
            del self._owner[p]
        self._free.extend(pages)
        return len(pages)

    def check(self) -> None:
        """Assert the allocator's invariant (used by the tests and the engine's debug mode)."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError("a page is on the free list twice")
        owned = [p for pages in self._pages.values() for p in pages]
        if len(set(owned)) != len(owned):
            raise AssertionError("a page is owned by two sequences (or twice by one)")
        if set(owned) & set(free):
            raise AssertionError(f"pages both free and owned: {sorted(set(owned) & set(free))[:8]}")
        if set(owned) != set(self._owner):
            raise AssertionError("owner map and page lists disagree")
        if len(free) + len(owned) != self.num_pages - self.reserved:
            raise AssertionError(f"{self.num_pages - self.reserved - len(free) - len(owned)} pages leaked")
        if any(p < self.reserved for p in free + owned):
            raise AssertionError("a reserved page was handed out")
