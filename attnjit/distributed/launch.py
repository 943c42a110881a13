"""Start a context-parallel group on one host: N processes (torch.multiprocessing, spawn), one torch.distributed
process group (gloo on CPUs, NCCL on GPUs, rendezvous through a file in a fresh temporary directory).

    launch(fn, 2, "a", backend="gloo")   # runs fn(rank, world, "a") in 2 processes; returns when all finished

``fn`` must be importable by name (a module-level function), as spawned processes import it. With NCCL, rank r
uses ``cuda:r``. An exception in any rank is raised in the caller (torch.multiprocessing's ProcessRaisedException
carries the rank's traceback).
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = ("gloo", "nccl")


def _entry(rank: int, fn: Callable, world: int, init_file: str, backend: str, timeout_s: float, args: tuple) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, world: int, *args: Any, backend: str = "gloo", timeout_s: float = 300.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks of one process group; raise if any rank failed."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(f"backend 'nccl' with world={world} needs {world} GPUs; this host has "
                           f"{torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="attnjit-cp-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_entry, args=(fn, world, init_file, backend, timeout_s, args), nprocs=world, join=True)
