"""Tile configurations and tuning records (issue 11): the spec's tile field, the sm90 family's named configurations,
the record store (content-addressed, trusted, atomic), plan() running the recorded tile, and `attnjit tune`'s errors
without a GPU. The timing itself runs on the GPU (tests/gpu/test_attention.py::test_tuning_record_picks_...)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnjit import families, tuning
from attnjit.cache import Cache
from attnjit.errors import UnsafeCacheError
from attnjit.families import sm90
from attnjit.ops.attention import BatchPrefillWithPagedKVCacheWrapper
from attnjit.specs import AttentionSpec, SpecError
from tests.helpers import i32

ROOT = Path(__file__).resolve().parents[1]
PREFILL = dict(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4, arch="sm_90a")
GPU = tuning.gpu_id("sm_90a", 132)   # what plan() asks for on this machine (no GPU: ATTNJIT_NUM_SMS default 132)


def test_tile_field_names_a_configuration_of_the_family():
    # head_dim 64 and 128 over a 16-bit cache also have the three-consumer tile; head_dim 256 and fp8 caches do not
    every = ("kv128", "kv128q1", "kv64s3", "kv128t8", "kv128s3q1", "kv128c", "q192kv64", "kv160", "kv176q1")
    assert families.tile_names(AttentionSpec(**PREFILL)) == every
    assert families.tile_names(AttentionSpec(**{**PREFILL, "head_dim": 64})) == every
    fp8 = {k: v for k, v in PREFILL.items() if k != "dtype"}
    assert families.tile_names(AttentionSpec(**fp8, dtype_q="bf16", dtype_o="bf16", dtype_kv="e4m3")) == every[:6]
    # attnjit tune searches only the configurations that have run on a GPU (all but kv128s3q1 and kv128c now), and
    # plan() takes no record of another
    assert families.tunable_names(AttentionSpec(**PREFILL)) == tuple(n for n in every
                                                                     if n not in ("kv128s3q1", "kv128c"))
    assert families.tunable_names(AttentionSpec(**{**PREFILL, "head_dim": 256})) == ("kv64q1",)
    assert families.tile_names(AttentionSpec(**{**PREFILL, "head_dim": 256})) == ("kv64q1",)
    spec = AttentionSpec(**PREFILL, tile="kv64s3")
    assert '"tile":"kv64s3"' in spec.canonical() and "tkv64s3" in spec.short_name()
    assert sm90.tiles(spec)[0].cta_kv == 64 and sm90.tiles(spec)[0].stages == 3
    # the default configuration compiles to the same code as no tile: it is the same spec
    assert AttentionSpec(**PREFILL, tile="kv128") == AttentionSpec(**PREFILL)
    with pytest.raises(SpecError) as e:
        AttentionSpec(**PREFILL, tile="kv999")
    assert e.value.field == "tile" and "kv128q1" in str(e.value)
    with pytest.raises(SpecError, match="fa2 family's tile configurations .* none"):
        AttentionSpec(**PREFILL, family="fa2", tile="kv64s3")
    assert spec.replace(family="fa2").tile is None  # tile configurations belong to a family


def test_each_configuration_fits_and_matches_the_traits_formula():
    for name in sm90.CONFIGS:
        tile = sm90.tiles(AttentionSpec(**PREFILL, tile=name))[0]
        assert tile.smem <= 227 * 1024 and tile.threads == 384
    for name in sm90.CONFIGS_3:
        tile = sm90.tiles(AttentionSpec(**PREFILL, tile=name))[0]
        assert tile.smem <= 227 * 1024 and tile.threads == 512 and tile.cta_q == 192
    from attnjit.generator import render

    src = render(AttentionSpec(**PREFILL, tile="kv64s3")).source
    assert "Sm90Traits<T, TO, TKV, HEAD_DIM, GROUP, CAUSAL, PAGED, PAGE_SIZE, KV_HND,\n    64, 3, 2, 0, 2>" in src
    src = render(AttentionSpec(**PREFILL, tile="kv128t8")).source
    assert "KV_HND,\n    128, 2, 2, 8, 2>" in src and "attnjit_sm90_q128_kv128_s2q2_t8_ws" in src
    src = render(AttentionSpec(**PREFILL, tile="q192kv64")).source
    assert "KV_HND,\n    64, 3, 2, 0, 3>" in src and "attnjit_sm90_q192_kv64_s3q2_ws" in src


def _record(spec: AttentionSpec, tile: str, gpu: str = GPU) -> tuning.Record:
    return tuning.Record(spec=tuning.untuned(spec).canonical(), gpu=gpu, tile=tile, ms={"kv128": 1.0, tile: 0.9},
                         workload="test", device="test")


def test_records_are_content_addressed_and_round_trip(tmp_path, monkeypatch):
    store = tuning.TuningStore(Cache(tmp_path / "root", layers=()))
    spec = AttentionSpec(**PREFILL)
    assert store.lookup(spec, GPU) is None
    path = store.write(_record(spec, "kv64s3"))
    assert path.parent == tmp_path / "root" / "tuning" and oct(path.stat().st_mode & 0o777) == "0o600"
    assert store.lookup(spec, GPU).tile == "kv64s3"
    assert store.lookup(AttentionSpec(**PREFILL, tile="kv128q1"), GPU).tile == "kv64s3"  # the untuned spec's
    assert store.lookup(spec, tuning.gpu_id("sm_90a", 114)) is None                       # another GPU
    assert store.lookup(AttentionSpec(**{**PREFILL, "group_size": 8}), GPU) is None      # another spec
    assert not list(path.parent.glob(".*.part"))                                           # no temp file left
    store.write(_record(spec, "q192kv64"))
    assert store.lookup(spec, GPU).tile == "q192kv64"
    monkeypatch.setattr(sm90, "UNTUNED", frozenset({"q192kv64"}))   # as if it had not run on a GPU yet
    assert "q192kv64" not in families.tunable_names(spec)
    with pytest.warns(tuning.BadTuningRecordWarning, match="tile 'q192kv64' is not a configuration attnjit tune"):
        assert store.lookup(spec, GPU) is None


def test_a_record_is_never_written_through_a_symlinked_tuning_directory(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir(mode=0o700)
    outside.mkdir()
    (root / "tuning").symlink_to(outside)
    with pytest.raises(UnsafeCacheError, match=re.escape(f"{root / 'tuning'} is a symlink, not a directory")):
        tuning.TuningStore(Cache(root, layers=())).write(_record(AttentionSpec(**PREFILL), "kv64s3"))
    assert list(outside.iterdir()) == []


def test_a_layer_serves_records_and_untrusted_or_foreign_ones_are_ignored(tmp_path):
    layer = tmp_path / "layer"
    spec = AttentionSpec(**PREFILL)
    path = tuning.TuningStore(Cache(layer, layers=())).write(_record(spec, "kv128q1"))
    store = tuning.TuningStore(Cache(tmp_path / "root", layers=(layer,)))
    assert store.lookup(spec, GPU).tile == "kv128q1"
    os.chmod(path, 0o666)   # writable by others: a record could steer which kernel runs; refused
    with pytest.warns(tuning.BadTuningRecordWarning, match="writable by other users"):
        assert store.lookup(spec, GPU) is None
    os.chmod(path, 0o600)
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "gpu": "sm_80/108sm"}))   # a record of another GPU under this key
    with pytest.warns(tuning.BadTuningRecordWarning, match="not a record of this spec"):
        assert store.lookup(spec, GPU) is None
    path.write_text("{not json")
    with pytest.warns(tuning.BadTuningRecordWarning):
        assert store.lookup(spec, GPU) is None


def test_a_record_nested_too_deeply_is_ignored_not_a_recursion_error(tmp_path):
    store = tuning.TuningStore(Cache(tmp_path / "root", layers=()))
    spec = AttentionSpec(**PREFILL)
    path = store.write(_record(spec, "kv64s3"))
    path.write_text("[" * 60_000)  # under the record's size limit
    with pytest.warns(tuning.BadTuningRecordWarning, match=f"ignoring tuning record {path}: nested too deeply"):
        assert store.lookup(spec, GPU) is None


def _plan(wrapper) -> None:
    wrapper.plan(i32([0, 300]), i32([0, 19]), i32(list(range(19))), i32([12]), 32, 8, 128, 16, causal=True,
                 q_data_type=torch.bfloat16)


def test_plan_runs_the_recorded_tile_and_a_forced_one(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNJIT_CACHE_DIR", str(tmp_path / "cache"))
    tuning.clear_memo()
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    w = BatchPrefillWithPagedKVCacheWrapper(ws)
    _plan(w)
    assert w._plan.spec.family == "sm90" and w._plan.spec.tile is None
    tuning.TuningStore(Cache(tmp_path / "cache")).write(_record(w._plan.spec, "kv64s3"))
    w2 = BatchPrefillWithPagedKVCacheWrapper(ws)
    _plan(w2)
    assert w2._plan.spec.tile == "kv64s3"
    assert w2.last_plan["tile"] == sm90.tiles(w2._plan.spec)[0].name == "q128_kv64_s3q2_ws"
    forced = BatchPrefillWithPagedKVCacheWrapper(ws, tile="kv128q1")   # the wrapper's own choice wins
    _plan(forced)
    assert forced._plan.spec.tile == "kv128q1"
    bad = BatchPrefillWithPagedKVCacheWrapper(ws, tile="kv7")
    with pytest.raises(ValueError, match="tile='kv7'"):
        _plan(bad)
    with pytest.raises(TypeError, match="tile must be"):
        BatchPrefillWithPagedKVCacheWrapper(ws, tile=3)
    tuning.clear_memo()


def test_tune_without_a_gpu_is_one_error_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the timing runs in tests/gpu")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "attnjit.cli", "tune", "--spec",
                           "op=prefill,head_dim=128,page_size=16,dtype=bf16,mask=causal,group_size=4",
                           "--cache-dir", str(tmp_path / "c")], capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0
    assert "needs a CUDA GPU" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "attnjit.cli", "tune", "--shape", "8by2048", "--spec", "op=prefill"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "BATCHxLENGTH" in proc.stderr
