"""Integer handles for the batch wrappers, so a custom op (torch.ops.attnjit.batch_run) can name the wrapper whose
plan it runs: torch.compile passes ints through a graph, not Python objects. A handle does not keep its wrapper
alive; a call on a collected wrapper's handle is an error that says so."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

_wrappers: dict[int, weakref.ref] = {}
_ids = itertools.count(1)


def register(wrapper: Any) -> int:
    handle = next(_ids)
    _wrappers[handle] = weakref.ref(wrapper, lambda _ref, h=handle: _wrappers.pop(h, None))
    return handle


def lookup(handle: int) -> Any:
    ref = _wrappers.get(handle)
    wrapper = ref() if ref is not None else None
    if wrapper is None:
        raise RuntimeError(f"attnjit wrapper handle {handle} names no live wrapper (it was garbage-collected); keep "
                           "the wrapper alive as long as the compiled code that runs it")
    return wrapper
