"""Element types: the one table every other module reads (spec names and aliases, bytes, C++ type, torch dtype).

The kernels compute in the query's 16-bit type (over an fp8 KV cache: in fp16, a bf16 q rescaled per row); an fp8
cache (``e4m3``, ``e5m2``) is stored in one byte per element and converted exactly on its way from shared memory into
the tensor cores (``templates/include/attnjit/fp8.cuh``, ``fa2/fp8_frags.cuh``). Spec fields, catalogs and plan()
arguments name types by any alias below (or a torch dtype); specs keep the canonical name. torch is not
imported here (``attnjit warm`` on a build machine never imports it): a type names its torch dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ElementType:
    name: str            # canonical spec/catalog name
    bytes: int           # size of one element
    ctype: str           # C++ type in the kernels
    torch_name: str      # the torch dtype's attribute name (torch.<torch_name>)
    aliases: tuple[str, ...] = ()

    @property
    def torch(self) -> Any:
        import torch

        return getattr(torch, self.torch_name)

    @property
    def is_fp8(self) -> bool:
        return self.bytes == 1


TYPES: dict[str, ElementType] = {t.name: t for t in (
    ElementType("fp16", 2, "__half", "float16", ("float16", "half")),
    ElementType("bf16", 2, "__nv_bfloat16", "bfloat16", ("bfloat16",)),
    ElementType("e4m3", 1, "__nv_fp8_e4m3", "float8_e4m3fn", ("float8_e4m3fn", "fp8_e4m3", "float8_e4m3")),
    ElementType("e5m2", 1, "__nv_fp8_e5m2", "float8_e5m2", ("float8_e5m2", "fp8_e5m2")),
)}

COMPUTE = ("fp16", "bf16")    # types of q and o (the kernels' arithmetic type)
FP8 = ("e4m3", "e5m2")        # KV cache types stored in one byte (with q/o in a COMPUTE type)

_BY_KEY: dict[str, ElementType] = {}
for _t in TYPES.values():
    for _k in (_t.name, *_t.aliases, _t.torch_name, f"torch.{_t.torch_name}"):
        _BY_KEY[_k] = _t


def lookup(value: Any) -> ElementType | None:
    """The element type a name, alias or torch dtype denotes (None: not one of attnjit's)."""
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":  # str(torch.float16) = "torch.float16"
        return _BY_KEY.get(str(value))
    if isinstance(value, str):
        return _BY_KEY.get(value.strip().lower())
    return None


def of(name: str) -> ElementType:
    """The element type of a canonical name (a spec's field)."""
    return TYPES[name]


def is_fp8(name: str | None) -> bool:
    return name in FP8
