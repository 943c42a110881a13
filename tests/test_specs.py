"""AttentionSpec validation and canonical form; TOML spec catalogs (expansion, dedupe, errors, committed files)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from attnjit.errors import CatalogError
from attnjit.specs import (DEFAULT_ARCH, HEAD_DIMS, AttentionSpec, SpecError, dump_catalog, expand_table,
                           load_catalog)
from tests.cpu_support import REPO
from tests.gpu.cases import all_specs

PREFILL = dict(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4)

# A spec of every op and kv kind, for the round-trip tests.
EXAMPLES = [
    AttentionSpec(**PREFILL),
    AttentionSpec(op="prefill", head_dim=64, dtype="fp16", kv="ragged", group_size=8),
    AttentionSpec(op="prefill", head_dim=256, page_size=1, dtype_q="fp16", dtype_kv="fp16", dtype_o="bf16",
                  layout="HND"),
    AttentionSpec(op="decode", head_dim=128, page_size=16, dtype="bf16", group_size=7, arch="sm_80"),
    AttentionSpec(op="merge_state", head_dim=64, dtype="fp16"),
    AttentionSpec(op="append_kv", head_dim=128, page_size=8, dtype="bf16", layout="HND"),
]


# --- validation -----------------------------------------------------------------------------------------

# (kwargs, field named, value shown, words of the allowed set)
BAD_SPECS = [
    (dict(PREFILL, head_dim=96), "head_dim_qk", "96", "64, 128, 256"),
    (dict(op="merge_state", head_dim=80, dtype="fp16"), "head_dim_vo", "80", "64, 128, 256"),
    (dict(PREFILL, dtype="fp32"), "dtype_q", "'fp32'", "fp16, bf16"),
    (dict(op="decode", head_dim=128, page_size=16, dtype_q="fp16", dtype_kv="fp16", dtype_o="float64"), "dtype_o",
     "'float64'", "fp16, bf16"),
    (dict(PREFILL, dtype_o="fp16"), "dtype_o", "'fp16'", "conflicts with dtype='bf16'"),
    (dict(PREFILL, page_size=1025), "page_size", "1025", "an integer from 1 to 1024"),
    (dict(PREFILL, page_size=12.0), "page_size", "12.0", "an integer from 1 to 1024"),
    (dict(PREFILL, page_size=0), "page_size", "0", "an integer from 1 to 1024"),
    (dict(PREFILL, page_size=-4), "page_size", "-4", "an integer from 1 to 1024"),
    (dict(PREFILL, page_size=True), "page_size", "True", "an integer from 1 to 1024"),
    (dict(PREFILL, group_size=0), "group_size", "0", "from 1 to 64"),
    (dict(PREFILL, group_size=65), "group_size", "65", "from 1 to 64"),
    (dict(op="merge_state", head_dim=64, dtype="fp16", page_size=16), "page_size", "16", "does not use page_size"),
    (dict(op="merge_state", head_dim=64, dtype="fp16", group_size=4), "group_size", "4", "does not use group_size"),
    (dict(op="append_kv", head_dim=64, page_size=16, dtype="fp16", kv="paged"), "kv", "'paged'", "does not use kv"),
    (dict(op="decode", head_dim=128, page_size=16, dtype="fp16", mask="causal"), "mask", "'causal'",
     "does not use mask"),
    (dict(op="prefill", head_dim=128, dtype="fp16", kv="ragged", page_size=16), "page_size", "16",
     "ragged KV has no pages"),
    (dict(op="prefill", head_dim=128, dtype="fp16", kv="ragged", layout="HND"), "layout", "'HND'", "NHD"),
    (dict(op="decode", head_dim=128, dtype="fp16", kv="ragged"), "kv", "'ragged'", "paged"),
    (dict(PREFILL, mask="sliding"), "mask", "'sliding'", "none, causal"),
    (dict(PREFILL, layout="NDH"), "layout", "'NDH'", "NHD, HND"),
    (dict(PREFILL, arch="sm_75"), "arch", "'sm_75'", ">= 80"),
    (dict(PREFILL, arch="hopper"), "arch", "'hopper'", "sm_90a"),
    (dict(op="attention", head_dim=128), "op", "'attention'", "prefill, decode, merge_state, append_kv"),
    (dict(PREFILL, head_dim_vo=64), "head_dim_vo", "64", "conflicts with head_dim=128"),
    (dict(PREFILL, dtype_kv="fp16"), "dtype_kv", "'fp16'", "conflicts with dtype='bf16'"),
    (dict(op="prefill", head_dim_qk=128, head_dim_vo=64, page_size=16, dtype="fp16"), "head_dim_vo", "64",
     "must equal head_dim_qk=128"),
    (dict(op="prefill", head_dim=128, page_size=16, dtype_q="fp16", dtype_kv="bf16"), "dtype_kv", "'bf16'",
     "must equal dtype_q='fp16'"),
    (dict(op="decode", page_size=16, dtype="fp16"), "head_dim_qk", "None", "needs it"),
    (dict(op="decode", head_dim=128, page_size=16), "dtype_q", "None", "needs it"),
]


@pytest.mark.parametrize("kwargs,field,value,allowed", BAD_SPECS,
                         ids=[f"{b[1]}={b[2]}" for b in BAD_SPECS])
def test_bad_spec_names_field_value_and_what_is_allowed(kwargs, field, value, allowed):
    with pytest.raises(ValueError) as info:
        AttentionSpec(**kwargs)
    err = info.value
    assert isinstance(err, SpecError)
    assert err.field == field
    msg = str(err)
    assert f"AttentionSpec.{field}={value}" in msg, msg
    assert allowed in msg, msg


def test_from_dict_rejects_unknown_fields_by_name():
    with pytest.raises(SpecError, match=r"AttentionSpec\.colour='red'.*unknown field; known fields: .*head_dim"):
        AttentionSpec.from_dict({**PREFILL, "colour": "red"})


def test_parse_rejects_items_that_are_not_key_value():
    with pytest.raises(ValueError, match="'head_dim' is not key=value"):
        AttentionSpec.parse("op=prefill,head_dim")


def test_defaults_are_filled_per_op():
    s = AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="fp16")
    assert (s.kv, s.layout, s.group_size, s.mask, s.arch, s.dtype_o) == ("paged", "NHD", 1, "none", DEFAULT_ARCH,
                                                                          "fp16")
    r = AttentionSpec(op="prefill", head_dim=128, dtype="fp16", kv="ragged")
    assert r.layout is None and r.page_size is None
    m = AttentionSpec(op="merge_state", head_dim=64, dtype="bf16")
    assert (m.head_dim_qk, m.head_dim_vo, m.dtype_q, m.dtype_kv, m.dtype_o, m.page_size, m.layout, m.kv) == \
        (None, 64, None, None, "bf16", None, None, None)
    a = AttentionSpec(op="append_kv", head_dim=64, page_size=4, dtype="fp16")
    assert (a.head_dim_qk, a.head_dim_vo, a.dtype_kv, a.dtype_q, a.layout) == (64, 64, "fp16", None, "NHD")


# --- aliases, equality, hashing --------------------------------------------------------------------------

def test_head_dim_and_dtype_aliases_expand_to_the_explicit_fields():
    short = AttentionSpec(**PREFILL)
    explicit = AttentionSpec(op="prefill", head_dim_qk=128, head_dim_vo=128, page_size=16, dtype_q="bf16",
                             dtype_kv="bf16", dtype_o="bf16", mask="causal", group_size=4)
    assert short == explicit
    assert (short.head_dim_qk, short.head_dim_vo) == (128, 128)
    assert (short.dtype_q, short.dtype_kv, short.dtype_o) == ("bf16", "bf16", "bf16")


@pytest.mark.parametrize("name", ["bf16", "bfloat16", "BFloat16", "torch.bfloat16", " bf16 "])
def test_dtype_names_canonicalize(name):
    assert AttentionSpec(**dict(PREFILL, dtype=name)).dtype_q == "bf16"


def test_dtype_alias_agrees_with_an_explicit_field_in_another_spelling():
    # dtype="bfloat16" and dtype_q="bf16" say the same thing: no conflict
    s = AttentionSpec(**dict(PREFILL, dtype="bfloat16", dtype_q="bf16"))
    assert s == AttentionSpec(**PREFILL)


def test_output_dtype_can_differ_from_the_input_dtype():
    s = AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype_q="bf16", dtype_kv="bf16", dtype_o="fp16")
    assert (s.dtype_q, s.dtype_o) == ("bf16", "fp16")
    assert s != AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="bf16")


def test_equal_specs_hash_equal_and_differ_by_every_field():
    a = AttentionSpec(**PREFILL)
    b = AttentionSpec(**dict(PREFILL, dtype="bfloat16"))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    variants = [AttentionSpec(**dict(PREFILL, **change)) for change in (
        {"head_dim": 64}, {"page_size": 1}, {"dtype": "fp16"}, {"mask": "none"}, {"group_size": 8},
        {"layout": "HND"}, {"arch": "sm_80"}, {"dtype": None, "dtype_q": "bf16", "dtype_kv": "bf16",
                                                 "dtype_o": "fp16"})]
    variants.append(AttentionSpec(op="decode", head_dim=128, page_size=16, dtype="bf16", group_size=4))
    assert len({a, *variants}) == len(variants) + 1
    assert all(v != a for v in variants)


def test_spec_is_frozen():
    s = AttentionSpec(**PREFILL)
    with pytest.raises(AttributeError):
        s.page_size = 1  # type: ignore[misc]


# --- canonical form ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", EXAMPLES, ids=lambda s: s.short_name())
def test_canonical_form_round_trips(spec):
    text = spec.canonical()
    assert AttentionSpec.from_dict(json.loads(text)) == spec
    assert AttentionSpec.parse(text) == spec
    assert AttentionSpec.parse(spec.as_flags()) == spec
    # compact JSON, fields in declaration order, nothing unset
    assert " " not in text and "null" not in text
    order = [f for f in AttentionSpec.__dataclass_fields__ if f in json.loads(text)]
    assert list(json.loads(text)) == order


def test_canonical_form_is_one_string_per_spec():
    a = AttentionSpec(**PREFILL)
    b = AttentionSpec.parse("group_size=4, mask=causal,dtype=bfloat16 ,page_size=16,head_dim=128,op=prefill")
    assert a.canonical() == b.canonical()
    assert a.canonical() == ('{"op":"prefill","head_dim_qk":128,"head_dim_vo":128,"page_size":16,"dtype_q":"bf16",'
                             '"dtype_kv":"bf16","dtype_o":"bf16","mask":"causal","layout":"NHD","kv":"paged",'
                             '"group_size":4,"family":"sm90","arch":"sm_90a"}')
    # mask is only part of prefill's canonical form (it is always "none" elsewhere)
    assert "mask" not in AttentionSpec(op="decode", head_dim=128, page_size=16, dtype="fp16").canonical()


def test_replace_revalidates():
    s = AttentionSpec(**PREFILL)
    assert s.replace(page_size=1).page_size == 1
    assert s.replace(page_size=528).page_size == 528  # any size 1..1024
    with pytest.raises(SpecError, match="page_size"):
        s.replace(page_size=1025)


# --- catalogs ---------------------------------------------------------------------------------------------

def _catalog(tmp_path: Path, text: str, name: str = "catalog.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_expand_table_is_a_cartesian_product_in_key_order():
    combos = expand_table({"op": "decode", "page_size": [1, 16], "dtype": ["fp16", "bf16", "fp16"]})
    assert combos == [
        {"op": "decode", "page_size": 1, "dtype": "fp16"}, {"op": "decode", "page_size": 1, "dtype": "bf16"},
        {"op": "decode", "page_size": 1, "dtype": "fp16"}, {"op": "decode", "page_size": 16, "dtype": "fp16"},
        {"op": "decode", "page_size": 16, "dtype": "bf16"}, {"op": "decode", "page_size": 16, "dtype": "fp16"},
    ]


def test_catalog_expands_in_file_then_key_order(tmp_path):
    path = _catalog(tmp_path, """
[[spec]]
op = "decode"
head_dim = 128
page_size = [1, 16]
dtype = ["fp16", "bf16"]
group_size = [4, 8]

[[spec]]
op = "merge_state"
head_dim = [64, 128]
dtype = "fp16"
""")
    specs = load_catalog(path)
    assert len(specs) == 2 * 2 * 2 + 2
    expected = [AttentionSpec(op="decode", head_dim=128, page_size=p, dtype=d, group_size=g)
                for p in (1, 16) for d in ("fp16", "bf16") for g in (4, 8)]
    expected += [AttentionSpec(op="merge_state", head_dim=h, dtype="fp16") for h in (64, 128)]
    assert specs == expected


def test_catalog_dedupes_equal_specs_keeping_the_first(tmp_path):
    path = _catalog(tmp_path, """
[[spec]]
op = "merge_state"
head_dim = [64, 128]
dtype = ["fp16", "half", "float16"]

[[spec]]
op = "merge_state"
head_dim_vo = 128
dtype_o = "fp16"

[[spec]]
op = "merge_state"
head_dim = 64
dtype = "bf16"
""")
    assert load_catalog(path) == [AttentionSpec(op="merge_state", head_dim=64, dtype="fp16"),
                                  AttentionSpec(op="merge_state", head_dim=128, dtype="fp16"),
                                  AttentionSpec(op="merge_state", head_dim=64, dtype="bf16")]


def test_catalog_arch_fills_in_only_tables_that_name_none(tmp_path):
    path = _catalog(tmp_path, """
[[spec]]
op = "merge_state"
head_dim = 64
dtype = "fp16"

[[spec]]
op = "merge_state"
head_dim = 128
dtype = "fp16"
arch = "sm_100a"
""")
    assert [s.arch for s in load_catalog(path)] == [DEFAULT_ARCH, "sm_100a"]
    assert [s.arch for s in load_catalog(path, arch="sm_80")] == ["sm_80", "sm_100a"]


# (catalog text, table number in the message or None, field or None, words of the reason)
BAD_CATALOGS = {
    "toml-syntax": ("[[spec]]\nop = \"decode\"\nhead_dim = [128\n", None, None, "not valid TOML"),
    "unknown-key": ('[[spec]]\nop = "merge_state"\nhead_dim = 64\ndtype = "fp16"\n\n'
                    '[[spec]]\nop = "decode"\nheaddim = 128\n', 2, "headdim", "unknown field"),
    "bad-value": ('[[spec]]\nop = "merge_state"\nhead_dim = 64\ndtype = "fp16"\n\n'
                  '[[spec]]\nop = "decode"\nhead_dim = 128\ndtype = "fp16"\npage_size = [16, 2048]\n',
                  2, "page_size", "2048 is not supported: expected an integer from 1 to 1024"),
    "bad-head-dim": ('[[spec]]\nop = "decode"\nhead_dim = 96\ndtype = "fp16"\npage_size = 16\n', 1, "head_dim_qk",
                     "96 is not supported: allowed head dims are 64, 128, 256"),
    "missing-op": ('[[spec]]\nop = "merge_state"\nhead_dim = 64\ndtype = "fp16"\n\n'
                   '[[spec]]\nhead_dim = 64\ndtype = "fp16"\n', 2, "op", "missing; expected one of prefill"),
    "empty-list": ('[[spec]]\nop = "decode"\nhead_dim = 128\ndtype = "fp16"\npage_size = []\n', 1, "page_size",
                   "an empty list expands to no specs"),
    "nested-table": ('[[spec]]\nop = "decode"\nhead_dim = 128\npage_size = { value = 16 }\n', 1, "page_size",
                     "expected a scalar or a list of scalars"),
    "unknown-top-level": ('version = 2\n[[spec]]\nop = "merge_state"\nhead_dim = 64\ndtype = "fp16"\n', None,
                          "version", "unknown top-level key"),
    "no-tables": ('# nothing here\n', None, None, "no [[spec]] tables found"),
    "not-tables": ('spec = [1, 2]\n', 1, None, "expected a [[spec]] table, got 1"),
    "op-not-used-field": ('[[spec]]\nop = "merge_state"\nhead_dim = 64\ndtype = "fp16"\npage_size = 16\n', 1,
                          "page_size", "does not use page_size"),
}


@pytest.mark.parametrize("name", sorted(BAD_CATALOGS))
def test_bad_catalog_names_file_table_and_field(tmp_path, name):
    text, table, field, reason = BAD_CATALOGS[name]
    path = _catalog(tmp_path, text, f"{name}.toml")
    with pytest.raises(CatalogError) as info:
        load_catalog(path)
    err, msg = info.value, str(info.value)
    assert isinstance(err, ValueError)
    assert err.path == str(path) and msg.startswith(str(path))
    assert err.table == (None if table is None else table - 1)
    assert err.field == field
    if table is not None:
        assert f"[[spec]] table #{table}" in msg
    if field is not None:
        assert f"field {field!r}" in msg
    assert reason in msg, msg


def test_toml_syntax_error_reports_the_line(tmp_path):
    path = _catalog(tmp_path, '[[spec]]\nop = "decode"\nhead_dim = 128\npage_size = 16 16\n')
    with pytest.raises(CatalogError, match=r"not valid TOML: .*line 4"):
        load_catalog(path)


def test_missing_catalog_file_is_a_catalog_error(tmp_path):
    with pytest.raises(CatalogError, match=r"nope\.toml: cannot read"):
        load_catalog(tmp_path / "nope.toml")


def test_endless_or_huge_catalog_is_refused_without_reading_it_all(tmp_path, monkeypatch):
    """/dev/zero never ends: load_catalog reads at most MAX_TEXT_BYTES + 1 bytes and says so (a CatalogError), not
    the process's memory; a pipe with a writer (a shell's process substitution) is read to its end as before."""
    import threading

    import attnjit.specs as S

    monkeypatch.setattr(S, "MAX_TEXT_BYTES", 1 << 16)
    with pytest.raises(CatalogError, match=r"cannot read: more than 65536 bytes"):
        load_catalog("/dev/zero")
    fifo = tmp_path / "catalog.fifo"
    os.mkfifo(fifo)
    text = '[[spec]]\nop = "decode"\nhead_dim = 128\npage_size = 16\ndtype = "bf16"\n'
    writer = threading.Thread(target=lambda: fifo.write_text(text))
    writer.start()
    try:
        specs = load_catalog(fifo, arch="sm_80")
    finally:
        writer.join(timeout=10)
    assert [(s.op, s.head_dim_qk, s.page_size) for s in specs] == [("decode", 128, 16)]


@pytest.mark.parametrize("name,count", [("default.toml", 47), ("ci.toml", 5), ("bench.toml", 79)])
def test_committed_catalogs_load(name, count):
    specs = load_catalog(REPO / "specs" / name)
    assert len(specs) == count == len(set(specs))
    assert all(s.arch == DEFAULT_ARCH and (s.head_dim_qk or s.head_dim_vo) in HEAD_DIMS for s in specs)


def test_default_catalog_covers_both_dtypes_page_sizes_and_groups():
    specs = load_catalog(REPO / "specs" / "default.toml")
    decode = [s for s in specs if s.op == "decode"]
    assert {(s.page_size, s.dtype_q, s.group_size) for s in decode} == \
        {(p, d, g) for p in (1, 16) for d in ("fp16", "bf16") for g in (4, 7, 8)}
    assert all(s.mask == "causal" for s in specs if s.op == "prefill")


def test_gpu_test_catalog_is_in_sync_with_the_gpu_cases():
    """specs/gpu-tests.toml must list exactly what tests/gpu compiles; regenerate it with
    `python -m tests.gpu.cases > specs/gpu-tests.toml`."""
    assert load_catalog(REPO / "specs" / "gpu-tests.toml") == all_specs()


def test_ci_catalog_is_part_of_the_default_catalog():
    default = set(load_catalog(REPO / "specs" / "default.toml"))
    assert set(load_catalog(REPO / "specs" / "ci.toml")) <= default


def test_a_catalog_without_family_warms_every_family_plan_may_dispatch():
    """On sm_90a a prefill spec runs on sm90, and on fa2 for decode-like batches: a table that names no family gives
    both; on sm_80 only fa2; decode only fa2; a table that names a family gives just that one."""
    from attnjit.families import for_batch

    hopper = load_catalog(REPO / "specs" / "ci.toml", arch="sm_90a")
    prefill = [s for s in hopper if s.op == "prefill"]
    assert {s.family for s in prefill} == {"fa2", "sm90"}
    sm90 = next(s for s in prefill if s.family == "sm90")
    assert for_batch(sm90, forced=None, max_packed_rows=4) == "fa2" and sm90.replace(family="fa2") in prefill
    assert {s.family for s in load_catalog(REPO / "specs" / "ci.toml", arch="sm_80") if s.family} == {"fa2"}
    assert {s.family for s in hopper if s.op == "decode"} == {"fa2"}


def test_dump_catalog_round_trips(tmp_path):
    specs = list(dict.fromkeys(EXAMPLES + load_catalog(REPO / "specs" / "default.toml")))
    text = dump_catalog(specs, header="a header\n\nover lines")
    assert text.startswith("# a header\n#\n# over lines\n")
    assert text.count("[[spec]]") == len(specs)
    path = _catalog(tmp_path, text)
    assert load_catalog(path) == specs
    # arch is written out, so an --arch fill-in does not change a dumped catalog
    assert load_catalog(path, arch="sm_80") == specs
    assert re.search(r'^arch = "sm_80"$', text, re.M)


# --- catalog size -------------------------------------------------------------------------------------------

def test_a_catalog_of_12288_specs_loads_in_linear_time(tmp_path):
    """3 head dims x 8 page sizes x 2 dtypes x 64 groups x 2 masks x 2 layouts: 12,288 distinct specs (21 s when
    de-duplication scanned a list, 0.2 s with a dict)."""
    import time

    path = tmp_path / "big.toml"
    path.write_text('[[spec]]\nop = "prefill"\nhead_dim = [64, 128, 256]\npage_size = [1, 2, 4, 8, 16, 32, 64, 128]\n'
                    f'dtype = ["fp16", "bf16"]\ngroup_size = {list(range(1, 65))}\nmask = ["none", "causal"]\n'
                    'layout = ["NHD", "HND"]\nfamily = "fa2"\n\n[[spec]]\nop = "merge_state"\nhead_dim = 64\n'
                    'dtype = "fp16"\n\n[[spec]]\nop = "prefill"\nhead_dim = 64\npage_size = 1\ndtype = "fp16"\n'
                    'family = "fa2"\n')  # a repeat
    t0 = time.perf_counter()
    specs = load_catalog(path)
    elapsed = time.perf_counter() - t0
    assert len(specs) == 12_289 and len(set(specs)) == len(specs)
    assert specs[-1] == AttentionSpec(op="merge_state", head_dim=64, dtype="fp16")
    assert elapsed < 5, f"12,289 specs took {elapsed:.1f} s"


def test_an_absurd_product_is_refused_with_its_count_before_expanding(tmp_path):
    import time

    path = tmp_path / "huge.toml"
    path.write_text('[[spec]]\nop = "merge_state"\nhead_dim = 64\ndtype = "fp16"\n\n[[spec]]\nop = "prefill"\n'
                    f'head_dim = [64, 128, 256]\npage_size = [1, 2, 4, 8, 16, 32, 64, 128]\ngroup_size = '
                    f'{list(range(1, 65))}\ndtype = ["fp16", "bf16"]\narch = {[f"sm_{n}" for n in range(80, 200)]}\n')
    t0 = time.perf_counter()
    with pytest.raises(CatalogError) as info:
        load_catalog(path)
    assert time.perf_counter() - t0 < 1, "the size was not computed before expanding"
    msg = str(info.value)
    assert msg == (f"{path}: expands to 368,641 specs, more than the 100,000 a catalog may hold (the largest, "
                   "[[spec]] table #2, is 3 head_dim x 8 page_size x 64 group_size x 2 dtype x 120 arch = 368,640); "
                   "narrow its lists or split the catalog, or pass --max-specs N if you mean it")
    small = tmp_path / "small.toml"
    small.write_text('[[spec]]\nop = "merge_state"\nhead_dim = [64, 128, 256]\ndtype = ["fp16", "bf16"]\n')
    with pytest.raises(CatalogError, match="expands to 6 specs, more than the 4 "):
        load_catalog(small, max_specs=4)
    assert len(load_catalog(small, max_specs=6)) == 6


def test_catalog_errors_pickle():
    import pickle

    err = CatalogError("a.toml", 2, "page_size", "24 is not supported")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), str(back), back.path, back.table, back.field) == (CatalogError, str(err), "a.toml", 2,
                                                                          "page_size")
