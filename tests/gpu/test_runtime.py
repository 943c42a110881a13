"""The runtime on a GPU: dispatch records, binary sources, strict mode, the JSONL log and the catalog it yields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnjit
from attnjit import dispatch

from ..helpers import make_paged

DEV = "cuda"
ROOT = Path(__file__).resolve().parents[2]


def _decode_once(group=4, page_size=16, dtype=torch.bfloat16):
    b = make_paged((1, 1), (50, 200), page_size=page_size, num_qo_heads=8 * group, num_kv_heads=8, head_dim=128,
                   dtype=dtype, device=DEV, seed=3)
    w = attnjit.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8, device=DEV))
    _, kvp, idx, last = b.tensors(DEV)
    w.plan(kvp, idx, last, 8 * group, 8, 128, page_size, q_data_type=dtype)
    return w, b


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("ATTNJIT_CACHE_DIR", str(root))
    monkeypatch.delenv("ATTNJIT_CACHE_PATH", raising=False)
    dispatch.clear_memory()
    yield root
    dispatch.clear_memory()


def test_records_built_then_memory_then_disk(private_cache):
    spec_group = 3  # a spec no other test compiles, so this process builds it
    with attnjit.recording() as rec:
        w, b = _decode_once(group=spec_group)
        w.run(b.q, b.cache)
        w.run(b.q, b.cache)
    assert [r.binary for r in rec] == ["built", "memory"]
    first = rec[0]
    assert first.op == "decode" and first.compile_ms and first.compile_ms > 0 and first.load_ms > 0
    spec = attnjit.AttentionSpec.from_dict(json.loads(first.spec))
    assert spec.group_size == spec_group and spec.op == "decode"
    assert first.kernel.startswith("attnjit_attention_") and first.block[0] == 128
    assert first.plan is not None and "split_kv" in first.plan and first.grid[0] == first.plan["ctas"]
    assert (private_cache / first.key[:2] / first.key / "kernel.cubin").is_file()
    dispatch.clear_memory()  # a fresh process would find it on disk
    with attnjit.recording() as rec2:
        w, b = _decode_once(group=spec_group)
        w.run(b.q, b.cache)
    assert rec2[0].binary == "disk" and rec2[0].compile_ms is None and rec2[0].key == first.key


def test_strict_mode_miss_names_spec_and_command(private_cache, monkeypatch):
    monkeypatch.setenv("ATTNJIT_JIT", "0")
    with pytest.raises(attnjit.CacheMissError) as info:
        _decode_once(group=5)
    msg = str(info.value)
    assert '"op":"decode"' in msg and "attnjit warm --spec" in msg and "group_size=5" in msg
    # the command in the message warms exactly that spec; afterwards strict mode runs from disk
    cmd = info.value.command.split()
    assert cmd[:2] == ["attnjit", "warm"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ATTNJIT_JIT")
    proc = subprocess.run([sys.executable, "-m", "attnjit.cli", *cmd[1:]], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "1 built" in proc.stdout
    with attnjit.recording() as rec:
        w, b = _decode_once(group=5)
        w.run(b.q, b.cache)
    assert rec[0].binary == "disk"


def test_jsonl_log_and_catalog_from_log(private_cache, tmp_path, monkeypatch):
    log = tmp_path / "run.jsonl"
    monkeypatch.setenv("ATTNJIT_LOG", str(log))
    w, b = _decode_once()
    w.run(b.q, b.cache)
    monkeypatch.delenv("ATTNJIT_LOG")
    w.run(b.q, b.cache)  # not logged: the variable is gone
    lines = log.read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["op"] == "decode" and record["binary"] in ("built", "disk", "memory")
    out = tmp_path / "from-log.toml"
    proc = subprocess.run([sys.executable, "-m", "attnjit.cli", "catalog", "from-log", str(log), "-o", str(out)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert attnjit.load_catalog(out) == [attnjit.AttentionSpec.from_dict(json.loads(record["spec"]))]


def test_memory_hits_never_rebuild_or_reload(private_cache):
    """run() on a memory hit launches without compiling or loading: the record says memory every time."""
    w, b = _decode_once()
    w.run(b.q, b.cache)
    with attnjit.recording() as rec:
        for _ in range(5):
            w.run(b.q, b.cache)
    assert [r.binary for r in rec] == ["memory"] * 5
