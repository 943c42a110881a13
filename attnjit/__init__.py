"""attnjit: JIT-generated paged/ragged/causal/GQA attention kernels for LLM serving.

The public API mirrors FlashInfer's (plan/run wrappers, merge_state with base-2 lse, append_paged_kv_cache), plus
what FlashInfer lacks: the dispatch record (``recording()``, ``ATTNJIT_LOG``), a content-addressed cubin cache,
strict no-compile mode (``ATTNJIT_JIT=0``) and spec catalogs to pre-warm.

Names are imported on first use, so ``attnjit warm`` on a build machine never imports torch or CuPy.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AttentionSpec": "specs", "SpecError": "specs", "load_catalog": "specs",
    "render": "generator", "ensure": "jit", "warm": "jit", "Cache": "cache",
    "recording": "dispatch", "Recording": "dispatch", "DispatchRecord": "dispatch",
    "BatchPrefillWithPagedKVCacheWrapper": "ops.attention", "BatchPrefillWithRaggedKVCacheWrapper": "ops.attention",
    "BatchDecodeWithPagedKVCacheWrapper": "ops.attention", "single_prefill_with_kv_cache": "ops.single",
    "BatchAttentionWithAttentionSinkWrapper": "ops.sinks", "MultiLevelCascadeAttentionWrapper": "ops.cascade",
    "single_decode_with_kv_cache": "ops.single",
    "merge_state": "ops.merge", "merge_state_in_place": "ops.merge", "merge_states": "ops.merge",
    "append_paged_kv_cache": "ops.page", "get_batch_indices_positions": "ops.page",
    "AttnjitError": "errors", "CacheError": "errors", "CacheMissError": "errors", "CacheReadOnlyError": "errors",
    "CatalogError": "errors", "CompileError": "errors", "LockTimeoutError": "errors", "NoGPUError": "errors",
    "NvccNotFoundError": "errors", "UnsafeCacheError": "errors",
    "Variant": "variants", "TensorParam": "variants",
}
_MODULES = ("reference", "specs", "generator", "cache", "jit", "dispatch", "knobs", "errors", "toolchain", "ops",
            "variants", "families", "tuning")

__all__ = sorted(_EXPORTS) + ["reference", "variants"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'attnjit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
