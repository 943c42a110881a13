"""Every case of the GPU matrix plans on the host within the GPU tests' workspace: a case plan() refuses (too many
partial-state slots, work items, a bad argument) is a test bug, and this finds it here rather than on the device
(run 46 spent a GPU run on one: 32768 slots against 16256)."""

from __future__ import annotations

import zlib

import pytest
import torch

from .gpu.cases import MATRIX, TILE_MATRIX
from .gpu.test_attention import WORKSPACE_BYTES, plan_case


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8)


@pytest.fixture(autouse=True)
def _h200(monkeypatch):
    monkeypatch.setenv("ATTNJIT_ARCH", "sm_90a")  # the device the GPU tests run on: 132 SMs of sm_90a
    monkeypatch.setenv("ATTNJIT_NUM_SMS", "132")


CASES = [(c, f, None) for c, f in MATRIX] + [(c, "sm90", t) for c, t in TILE_MATRIX]


@pytest.mark.parametrize("case,family,tile", CASES,
                         ids=[f"{c.name}-{f}" + (f"-{t}" if t else "") for c, f, t in CASES])
def test_gpu_case_plans_on_the_host(case, family, tile, workspace):
    w, _ = plan_case(case, workspace, seed=zlib.crc32(case.name.encode()) % 1000, family=family, tile=tile,
                     device="cpu")
    assert w.last_plan["family"] == (family if case.kind != "decode" else "fa2")  # decode runs on fa2
    if tile is not None:
        assert w._plan.spec.tile == tile
    assert w.last_plan["work_items"] >= 1 or sum(case.qo_lens) == 0
