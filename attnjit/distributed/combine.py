"""Combine the ranks' attention states (o, lse) over a torch.distributed group into the state of the whole history.

Each rank's keys are a disjoint part of every request's keys, so the merged state is ``merge_states`` of the ranks'
states (base-2 lse; an empty state (0, -inf) is the identity). Two ways to get there, one collective each where
possible:

- ``"all_gather"`` (default): the local kernel writes o and lse straight into one packed byte buffer
  ``[o bytes | lse bytes]`` (16-byte aligned parts), one all-gather brings every rank's buffer to every rank, and
  ``merge_states`` reads the gathered states through strided views (rank order). Every rank computes the same
  merge of the same bytes, so the result is bitwise equal on all ranks. Bytes moved per rank:
  (world - 1) x rows x H x (D x elem + 4).
- ``"all_reduce"``: the reduce of the merge. NCCL has no custom reduction, so it takes two all-reduces: MAX of lse
  (the shift m), then SUM of ``[w o, w]`` with ``w = 2^(lse - m)`` in float32 (float64 on the CPU); o = sum / w,
  lse = m + log2(w). Fewer bytes for large worlds, one more latency; the decode benchmark measures both.

The buffers are allocated once per state shape and reused, and ``combine()`` synchronizes nothing on the host, so
a decode step with its collective can be captured in a CUDA graph (NCCL allows collectives in a capture once the
communicator is initialized: run one step before capturing). On the CPU (gloo) the merge is attnjit.reference's
float64 one; on a GPU it is attnjit's merge_states kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import reference
from ..ops.merge import merge_states

METHODS = ("all_gather", "all_reduce")
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _round16(n: int) -> int:
    return -(-n // 16) * 16


class StateCombiner:
    """One rank's side of the combine. ``local_state(...)`` hands out the buffers the local kernel writes;
    ``combine()`` returns the merged (o [rows, H, D], lse [rows, H]) on every rank."""

    def __init__(self, group: dist.ProcessGroup | None = None, method: str = "all_gather"):
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if not dist.is_initialized():
            raise RuntimeError("StateCombiner needs torch.distributed initialized (dist.init_process_group, or "
                               "attnjit.distributed.launch)")
        self.group = group
        self.method = method
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._shape: tuple | None = None

    def local_state(self, rows: int, heads: int, dim: int, o_dtype: torch.dtype, lse_dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(o [rows, H, D], lse [rows, H]): contiguous views this rank's kernel writes its state into (the same
        tensors for the same shape, so a captured graph keeps its addresses)."""
        shape = (rows, heads, dim, o_dtype, lse_dtype, torch.device(device))
        if shape != self._shape:
            self._allocate(shape)
        return self._o, self._lse

    def _allocate(self, shape: tuple) -> None:
        rows, heads, dim, o_dtype, lse_dtype, device = shape
        o_bytes = _round16(rows * heads * dim * o_dtype.itemsize)
        lse_bytes = rows * heads * lse_dtype.itemsize
        chunk = _round16(o_bytes + lse_bytes)
        self._send = torch.zeros(chunk, dtype=torch.uint8, device=device)
        self._o = self._send[:rows * heads * dim * o_dtype.itemsize].view(o_dtype).view(rows, heads, dim)
        self._lse = self._send[o_bytes:o_bytes + lse_bytes].view(lse_dtype).view(rows, heads)
        if self.method == "all_gather":
            self._recv = torch.zeros(self.world * chunk, dtype=torch.uint8, device=device)
            r = self._recv.view(self.world, chunk)
            v = r[:, :rows * heads * dim * o_dtype.itemsize].view(o_dtype).unflatten(1, (rows, heads, dim))
            s = r[:, o_bytes:o_bytes + lse_bytes].view(lse_dtype).unflatten(1, (rows, heads))
            self._gathered = (v.permute(1, 0, 2, 3), s.permute(1, 0, 2))
        else:
            acc = torch.float64 if device.type == "cpu" else torch.float32
            self._max = torch.empty(rows, heads, dtype=acc, device=device)
            self._sum = torch.empty(rows, heads, dim + 1, dtype=acc, device=device)
        self._shape = shape

    def local(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's own state as the local kernel left it (the send buffer; combine() does not change it)."""
        if self._shape is None:
            raise RuntimeError("local() called before local_state()")
        return self._o, self._lse

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """After the all-gather: (v [rows, world, H, D], s [rows, world, H]) views of every rank's state (made with
        the receive buffer)."""
        return self._gathered

    def combine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The merged state of what the local buffers hold on every rank (a collective: every rank calls it)."""
        if self._shape is None:
            raise RuntimeError("combine() called before local_state()")
        if self.method == "all_gather":
            _all_gather(self._recv, self._send, group=self.group)
            v, s = self.gathered()
            return (reference.merge_states if v.device.type == "cpu" else merge_states)(v, s)
        return self._reduce()

    def _reduce(self) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self._shape[2]
        acc = self._max.dtype
        lse = self._lse.to(acc)
        self._max.copy_(lse)
        dist.all_reduce(self._max, op=dist.ReduceOp.MAX, group=self.group)
        m = torch.where(torch.isfinite(self._max), self._max, torch.zeros_like(self._max))
        w = torch.exp2(lse - m)                                   # 0 for an empty state
        self._sum[..., :dim].copy_(self._o.to(acc) * w[..., None])
        self._sum[..., dim].copy_(w)
        dist.all_reduce(self._sum, op=dist.ReduceOp.SUM, group=self.group)
        z = self._sum[..., dim]                                   # >= 1 where any rank has a key (w = 1 at m)
        o = self._sum[..., :dim] / z.clamp_min(1.0)[..., None]    # an empty row: 0 / 1
        # a NaN state (a NaN sum: its w is NaN) stays NaN, never the -inf of an empty row, which a later merge drops
        out_lse = torch.where(z > 0, m + torch.log2(z.clamp_min(1.0)),
                              torch.where(torch.isnan(z), z, torch.full_like(m, -float("inf"))))
        return o.to(self._o.dtype), out_lse.to(self._lse.dtype)
