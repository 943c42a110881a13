"""A Llama-style model served through attnjit: paged KV cache, page allocator, continuous batching (chunked
prefill mixed with decode), CUDA-graph decode buckets. See ``examples/llama_serving.py`` and README's "Serving a
model" section.

Attention goes through FlashInfer-shaped wrappers picked by name (``backend="attnjit" | "flashinfer" |
"reference"``), so the same call sites run attnjit, FlashInfer, or the float64 reference on a CPU.
"""

from .engine import Engine, EngineStats
from .llama import LlamaConfig, LlamaWeights, PagedLlama, transformers_logits
from .paging import OutOfPagesError, PageAllocator
from .scheduler import Request, Scheduler, StepBatch

__all__ = ["Engine", "EngineStats", "LlamaConfig", "LlamaWeights", "OutOfPagesError", "PageAllocator", "PagedLlama",
           "Request", "Scheduler", "StepBatch", "transformers_logits"]
