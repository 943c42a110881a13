"""Variants on the CPU: declarations, rendering, keys, real nvcc compiles, error messages, catalogs, run() checks."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

import attnjit
from attnjit import jit, variants as V
from attnjit.errors import CatalogError, CompileError
from attnjit.generator import render
from attnjit.specs import AttentionSpec, SpecError, load_catalog

from .gpu.cases import GAINS, HEAD_SCALE, USER_SIGMOID

BUILTINS = {"softcap": V.SOFTCAP, "sliding_window": V.SLIDING_WINDOW, "alibi": V.ALIBI,
            "custom_mask": V.CUSTOM_MASK, "sigmoid": V.SIGMOID}
USER = {"user_sigmoid": USER_SIGMOID, "head_scale": HEAD_SCALE, "gains": GAINS}


def prefill(variant=None, **kw) -> AttentionSpec:
    args = dict(op="prefill", head_dim=64, page_size=16, dtype="fp16", group_size=2, mask="causal")
    args.update(kw)
    return AttentionSpec(variant=variant, **args)


# --- the default path --------------------------------------------------------------------------------------

def test_default_spec_has_no_variant_code_and_no_variant_in_its_name():
    for spec in (prefill(), AttentionSpec(op="decode", head_dim=128, page_size=16, dtype="bf16", group_size=4)):
        src = render(spec).source
        assert "struct Variant" not in src and "VariantPart_" not in src
        assert "variant" not in spec.canonical()
        traits = {"fa2": "AttentionTraits<T, TO, TKV,", "sm90": "Sm90Traits<T, TO, TKV,"}[spec.family]
        assert f"{traits} HEAD_DIM, GROUP, CAUSAL, PAGED, PAGE_SIZE, KV_HND," in src
        assert ", Variant>" not in src  # the kernels instantiate the NoVariant default


def test_declaring_variants_does_not_change_default_keys():
    spec = prefill()
    before = hashlib.sha256(render.__wrapped__(spec).source.encode()).hexdigest()
    attnjit.Variant("noop", logits_transform="return logit;")
    after = hashlib.sha256(render.__wrapped__(spec).source.encode()).hexdigest()
    assert before == after


# --- declarations --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(name="has space"), ValueError, r"Variant name 'has space' must be an identifier"),
    (dict(params={"cap": str}), TypeError, r"parameter 'cap' has type .*declare float, int or attnjit.TensorParam"),
    (dict(params={"logit": float}), ValueError, r"parameter name 'logit' is taken by a hook variable"),
    (dict(params={"for": float}), ValueError, r"parameter name 'for' must be an identifier"),
    (dict(logits_transform=""), TypeError, r"logits_transform must be a string of CUDA code"),
    (dict(logits_mask=3), TypeError, r"logits_mask must be a string of CUDA code"),
    (dict(use_softmax=False), ValueError, r"use_softmax=False needs a logits_transform"),
    (dict(logits_scale="return 2.f;"), ValueError, r"logits_scale .* needs a logits_transform and use_softmax=True"),
    (dict(logits_transform="return logit;", logits_scale="return 2.f;", use_softmax=False), ValueError,
     r"logits_scale .* needs a logits_transform and use_softmax=True"),
])
def test_bad_declarations_name_the_variant_and_the_problem(kwargs, exc, pattern):
    kwargs = dict(kwargs)
    name = kwargs.pop("name", "v")
    with pytest.raises(exc, match=pattern):
        attnjit.Variant(name, **kwargs)


def test_bad_tensor_param_declarations():
    with pytest.raises(ValueError, match=r"TensorParam.dtype='float64' is not supported"):
        attnjit.TensorParam("float64")
    with pytest.raises(ValueError, match=r"TensorParam.per='row' is not supported"):
        attnjit.TensorParam("float32", per="row")


def test_variants_are_immutable_and_compare_by_content():
    a = attnjit.Variant("a", params={"c": float}, logits_transform="return logit * c;")
    b = attnjit.Variant("a", params={"c": float}, logits_transform="return logit * c;")
    c = attnjit.Variant("a", params={"c": float}, logits_transform="return logit * c * 1.f;")
    assert a == b and hash(a) == hash(b) and a != c
    with pytest.raises(AttributeError):
        a.name = "b"


def test_compose_rejects_a_parameter_declared_twice():
    with pytest.raises(ValueError, match=r"both declare parameter\(s\) \['logits_soft_cap'\]"):
        V.compose(V.SOFTCAP, attnjit.Variant("other", params={"logits_soft_cap": float}, logits_transform="return logit;"))


# --- specs, keys, catalogs -----------------------------------------------------------------------------------

def test_spec_names_an_importable_variant_by_module_attribute_and_round_trips():
    spec = prefill(HEAD_SCALE)
    assert json.loads(spec.canonical())["variant"] == "tests.gpu.cases:HEAD_SCALE"
    assert AttentionSpec.from_dict(json.loads(spec.canonical())) == spec
    assert AttentionSpec.parse(spec.as_flags()) == spec
    built = prefill(V.compose(V.SOFTCAP, V.SLIDING_WINDOW))
    assert json.loads(built.canonical())["variant"] == "attnjit.variants:SOFTCAP+attnjit.variants:SLIDING_WINDOW"
    assert AttentionSpec.from_dict(json.loads(built.canonical())) == built


def test_a_local_variant_is_named_by_digest_and_cannot_come_back_from_a_catalog():
    local = attnjit.Variant("local", logits_transform="return logit;")
    spec = prefill(local)
    name = json.loads(spec.canonical())["variant"]
    assert name.startswith("local@")
    with pytest.raises(SpecError, match="not importable"):
        AttentionSpec.from_dict(json.loads(spec.canonical()))


def test_variant_only_for_attention_ops():
    with pytest.raises(SpecError, match="does not use variant"):
        AttentionSpec(op="merge_state", head_dim=64, dtype="fp16", variant=V.SOFTCAP)


def test_catalog_names_variants_by_module_attribute(tmp_path):
    cat = tmp_path / "c.toml"
    cat.write_text('[[spec]]\nop = "decode"\nhead_dim = 128\npage_size = 16\ndtype = "bf16"\ngroup_size = 4\n'
                   'variant = ["attnjit.variants:SOFTCAP", "tests.gpu.cases:GAINS"]\n')
    specs = load_catalog(cat)
    assert [s.variant for s in specs] == [V.SOFTCAP, GAINS]
    cat.write_text('[[spec]]\nop = "decode"\nhead_dim = 128\npage_size = 16\ndtype = "bf16"\n'
                   'variant = "attnjit.variants:NOPE"\n')
    with pytest.raises(CatalogError, match=r"field 'variant'.*NOPE is NoneType, not an attnjit.Variant"):
        load_catalog(cat)


def test_key_changes_when_a_snippet_changes_and_only_then():
    a = attnjit.Variant("k", params={"c": float}, logits_transform="return logit * c;")
    a2 = attnjit.Variant("k", params={"c": float}, logits_transform="return logit * c;")
    b = attnjit.Variant("k", params={"c": float}, logits_transform="return logit * (c);")
    key = lambda v: jit.job_for(prefill(v)).key  # noqa: E731
    assert key(a) == key(a2)
    assert key(a) != key(b)
    assert key(a) != jit.job_for(prefill()).key


def test_rendered_variant_points_nvcc_at_the_snippet():
    src = render(prefill(HEAD_SCALE)).source
    assert '#line 1 "variant head_scale: logits_transform"' in src
    assert "return logit * head_scale[qo_head];" in src
    lines = src.splitlines()
    for i, line in enumerate(lines):  # every return to the rendered file names the real next line
        if line.startswith("#line ") and line.endswith('"kernel.cu"'):
            assert int(line.split()[1]) == i + 2


def test_hook_signatures_in_the_template_match_the_documented_variables():
    template = (attnjit.generator.TEMPLATE_DIR / "_variant.jinja").read_text()
    for hook, names in V.HOOK_VARIABLES.items():
        sig = template.split(f'"{hook}": (')[1].split(")")[0]
        args = sig.split('"')[3]
        assert [a.split()[-1] for a in args.split(",") if a.strip()] == list(names), hook


# --- real compiles -----------------------------------------------------------------------------------------------

@pytest.mark.nvcc
def test_every_builtin_and_user_variant_compiles(tmp_path):
    cache = attnjit.Cache(tmp_path / "cache", layers=())
    specs = [prefill(v) for v in list(BUILTINS.values()) + list(USER.values())]
    specs.append(AttentionSpec(op="decode", head_dim=64, page_size=16, dtype="bf16", group_size=4,
                               variant=V.compose(V.SOFTCAP, V.SLIDING_WINDOW, V.ALIBI)))
    results = jit.warm(specs, cache)
    failed = [(r.job.label, r.error.first_error) for r in results if r.status != "built"]
    assert not failed, failed


@pytest.mark.nvcc
def test_a_broken_snippet_names_the_variant_the_hook_and_the_line(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNJIT_CACHE_DIR", str(tmp_path / "cache"))
    broken = attnjit.Variant("broken", params={"cap": float},
                             logits_transform="float y = cap;\nreturn logitt * y;")
    with pytest.raises(CompileError) as info:
        jit.ensure(AttentionSpec(op="decode", head_dim=64, page_size=16, dtype="fp16", group_size=1, variant=broken))
    msg = info.value.first_error
    assert "variant 'broken', logits_transform line 2" in msg
    assert 'identifier "logitt" is undefined' in msg
    assert "names logits_transform can use: logit, qk, sm_scale, q_pos, kv_pos, rel_pos" in msg
    assert "parameters: cap" in msg
    assert info.value.log_path.exists()


# --- run() parameters, checked on a CPU-planned wrapper --------------------------------------------------------

def _planned(variant):
    i = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    w = attnjit.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), variant=variant)
    w.plan(i([0, 3, 4, 8]), i([0, 2, 3, 6]), i([7, 2, 11, 3, 14, 6]), i([2, 2, 1]), 32, 8, 128, 4, causal=True,
           q_data_type=torch.float16)
    return w, torch.randn(8, 32, 128, dtype=torch.float16), torch.randn(15, 2, 4, 8, 128, dtype=torch.float16)


@pytest.mark.parametrize("params, exc, pattern", [
    (dict(), TypeError, r"variant 'head_scale' needs parameter 'head_scale' \(Tensor\(float32, per qo_head\)\)"),
    (dict(head_scale=1.0), TypeError, r"parameter 'head_scale' must be a torch.Tensor"),
    (dict(head_scale=torch.ones(31)), ValueError, r"one value per qo_head: 32 elements expected, got 31"),
    (dict(head_scale=torch.ones(32), extra=1), TypeError, r"variant 'head_scale' has no parameter 'extra'"),
])
def test_run_checks_variant_parameters_before_anything_runs(params, exc, pattern):
    w, q, cache = _planned(HEAD_SCALE)
    with pytest.raises(exc, match=pattern):
        w.run(q, cache, **params)


def test_scalar_parameter_types_and_lse_of_a_non_softmax_variant():
    w, q, cache = _planned(USER_SIGMOID)
    with pytest.raises(TypeError, match=r"variant 'user_sigmoid': parameter 'scale' must be a float, got str"):
        w.run(q, cache, scale="1", bias=0.0)
    with pytest.raises(ValueError, match=r"use_softmax=False: its output has no log-sum-exp"):
        w.run(q, cache, scale=1.0, bias=0.0, return_lse=True)
    with pytest.raises(attnjit.NoGPUError):  # valid parameters: it gets as far as needing a GPU
        w.run(q, cache, scale=1.0, bias=0.0)


def test_builtins_bind_their_parameters_at_plan_time():
    w, q, cache = _planned(None)
    i = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    w.plan(i([0, 3, 4, 8]), i([0, 2, 3, 6]), i([7, 2, 11, 3, 14, 6]), i([2, 2, 1]), 32, 8, 128, 4, causal=True,
           logits_soft_cap=30.0, window_left=2, pos_encoding_mode="ALIBI")
    spec = w._plan.spec
    assert [p.name for p in spec.variant.parts] == ["softcap", "sliding_window", "alibi"]
    assert w._plan.binding.required == []
    with pytest.raises(TypeError, match="has no parameter 'logits_soft_cap'"):
        w.run(q, cache, logits_soft_cap=3.0)


def test_custom_mask_packing_is_little_endian_per_request():
    from attnjit.ops._variants import pack_mask_bits

    gen = torch.Generator().manual_seed(0)
    sizes = [18, 2, 36]
    mask = torch.rand(sum(sizes), generator=gen) < 0.5
    packed, indptr = pack_mask_bits(mask, sizes)
    want, pos = [], 0
    for n in sizes:  # bit i of a request's mask is bit i % 8 of its byte i // 8
        bits = mask[pos:pos + n].tolist()
        want += [sum(1 << j for j in range(8) if b * 8 + j < n and bits[b * 8 + j]) for b in range((n + 7) // 8)]
        pos += n
    assert packed.tolist() == want and indptr == [0, 3, 4, 9]


def test_the_parameter_struct_holds_every_variant_field_in_kernel_order():
    """What run() packs: the kernel's layout, built-ins bound at plan(), run()-time values in their slots."""
    from attnjit.generator import attention_layout, render, variant_param_name

    w, q, cache = _planned(HEAD_SCALE)
    i = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    w.plan(i([0, 3, 4, 8]), i([0, 2, 3, 6]), i([7, 2, 11, 3, 14, 6]), i([2, 2, 1]), 32, 8, 128, 4, causal=True,
           q_data_type=torch.float16, logits_soft_cap=30.0)
    plan = w._plan
    layout = attention_layout(plan.spec.variant, plan.spec.family)
    assert len(plan.attn_values) == len(layout.names)
    assert all(info.layout is layout for info in render(plan.spec).kernels.values())
    assert plan.attn_values[layout.index[variant_param_name("logits_soft_cap")]] == 30.0
    scale = torch.ones(32)
    with pytest.raises(attnjit.NoGPUError):
        w.run(q, cache, head_scale=scale)
    assert plan.attn_values[layout.index[variant_param_name("head_scale")]] == scale.data_ptr()
    layout.struct.pack(*plan.attn_values)  # packs: every field has a value of its type


@pytest.mark.nvcc
def test_position_and_scale_hooks_cost_no_conversion_or_extra_multiply_a_logit():
    """The sm90 main loop (causal, page 16, bf16: 64 logits a consumer thread a tile): ALiBi's bias through
    ``rel_pos`` converts no int a logit (it was 64 I2FP, quarter rate, with float(kv_pos - q_pos)); the soft-cap,
    folding ``sm_scale / cap`` into one multiply of ``qk``, adds two FMUL a logit to the default's (it was three)."""
    from benchmarks import sm90_sass as ss

    def loop(variant) -> dict[str, int]:
        spec = AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4,
                             family="sm90", arch="sm_90a", variant=variant)
        return ss.analyze(ss.sass_of(spec))["loop"]["opcodes"]

    default, alibi, softcap = loop(None), loop(V.ALIBI), loop(V.SOFTCAP)
    conversions = lambda c: c.get("I2F", 0) + c.get("I2FP", 0)  # noqa: E731
    assert conversions(alibi) <= conversions(default) + 4, alibi
    assert softcap["FMUL"] - default["FMUL"] <= 2 * 64 + 4, (softcap["FMUL"], default["FMUL"])
    assert softcap["MUFU"] - default["MUFU"] <= 64 + 2, softcap   # one tanh a logit


def test_mask_from_kv_start_is_declared_checked_composed_and_rendered():
    """A sliding window's mask is exactly its kv_start bound: it declares so (mask_from_kv_start), so that its
    kernels mask only the tiles below an item's bound (attnjit/work.cuh, tile_needs_mask); a composition keeps the
    declaration only while every masking part has it; every other variant's description (and digest) is as before."""
    assert V.SLIDING_WINDOW.mask_from_kv_start
    assert "mask_from_kv_start" in V.SLIDING_WINDOW.describe()
    for v in (V.SOFTCAP, V.ALIBI, V.CUSTOM_MASK, V.SIGMOID, USER_SIGMOID):
        assert not v.mask_from_kv_start and "mask_from_kv_start" not in v.describe()
    with pytest.raises(ValueError, match="needs both hooks"):
        V.Variant("half", logits_mask="return kv_pos % 2 == 0;", mask_from_kv_start=True)
    with pytest.raises(ValueError, match="needs both hooks"):
        V.Variant("start", kv_start="return q_pos - 4;", mask_from_kv_start=True)
    with pytest.raises(TypeError, match="True or False"):
        V.Variant("w", logits_mask="return true;", kv_start="return 0;", mask_from_kv_start=1)
    with pytest.raises(ValueError, match="reads qo_head"):   # kv_start has no qo_head: a per-head window can't declare
        V.Variant("per_head", logits_mask="return kv_pos >= q_pos - 8 * (qo_head + 1);",
                  kv_start="return q_pos - 8 * (kv_head + 1);", mask_from_kv_start=True)
    V.Variant("per_head", logits_mask="return kv_pos >= q_pos - 8 * (qo_head + 1);",
              kv_start="return q_pos - 8 * (kv_head + 1);")   # undeclared: the mask runs on every tile
    V.Variant("w", logits_mask="return kv_pos >= q_pos - 8;  // the same for every qo_head",
              kv_start="return q_pos - 8;", mask_from_kv_start=True)   # a comment's words are not code
    V.Variant("w", logits_mask="/* not per qo_head */ return kv_pos >= q_pos - 8;", kv_start="return q_pos - 8;",
              mask_from_kv_start=True)
    plain = V.Variant("w", logits_mask="return kv_pos >= q_pos - 8;", kv_start="return q_pos - 8;")
    declared = V.Variant("w", logits_mask="return kv_pos >= q_pos - 8;", kv_start="return q_pos - 8;",
                         mask_from_kv_start=True)
    assert plain != declared and plain.digest != declared.digest   # it changes the code, so the key
    assert V.compose(V.SOFTCAP, V.SLIDING_WINDOW).mask_from_kv_start
    assert V.compose(V.SLIDING_WINDOW, V.ALIBI, V.SOFTCAP).mask_from_kv_start
    assert not V.compose(V.SLIDING_WINDOW, V.CUSTOM_MASK).mask_from_kv_start   # the custom mask hides other keys
    assert not V.compose(V.SOFTCAP, V.ALIBI).mask_from_kv_start                # no mask at all
    assert "MASK_FROM_KV_START = true" in render(prefill(V.SLIDING_WINDOW)).source
    assert "MASK_FROM_KV_START = true" in render(prefill(V.compose(V.SOFTCAP, V.SLIDING_WINDOW))).source
    assert "MASK_FROM_KV_START = false" in render(prefill(V.CUSTOM_MASK)).source
    sm90 = dict(head_dim=128, dtype="bf16", group_size=4, family="sm90", arch="sm_90a")
    assert "MASK_FROM_KV_START = true" in render(prefill(V.SLIDING_WINDOW, **sm90)).source


@pytest.mark.nvcc
def test_sm90_sliding_window_compiles_without_spills(tmp_path):
    """The window's per-item bound (mask_from) is one more register of the work item: no spills in the sm90 kernel."""
    from .cpu_support import assert_no_spills, compile_kernel

    spec = AttentionSpec(op="prefill", head_dim=128, page_size=16, dtype="bf16", mask="causal", group_size=4,
                         family="sm90", arch="sm_90a", variant=V.SLIDING_WINDOW)
    log, sass = compile_kernel(tmp_path, spec, sass=True)
    assert_no_spills(log, sass, "the sm90 sliding-window kernel")
    assert "HGMMA" in sass


# --- logits_scale: a transform's constant factor folded into the softmax's scale ----------------------------------

def _variant_struct(variant) -> str:
    src = render.__wrapped__(prefill(variant)).source
    return src[src.index("struct Variant {"):].split("\n};", 1)[0]


def test_logits_scale_is_folded_only_for_the_last_transform_of_a_chain():
    """The softmax applies the last logits transform's logits_scale (HAS_LOGITS_SCALE, logits_scale() NaN unless
    positive); an earlier part's factor is multiplied in before the next part sees the logit; no scale, no flag."""
    alone = _variant_struct(V.SOFTCAP)
    assert "HAS_LOGITS_SCALE = true" in alone and "softcap_.logits_scale(sm_scale)" in alone
    assert "__int_as_float(0x7fffffff)" in alone          # the NaN for a scale that is not positive and finite
    # soft-cap then ALiBi: the cap multiplied in the chain (with the row's sm_scale), ALiBi's scale folded; ALiBi's
    # logit is the soft-cap's result, so its sm_scale (and the factor it returns) is 1
    both = _variant_struct(V.compose(V.SOFTCAP, V.ALIBI))
    assert "HAS_LOGITS_SCALE = true" in both and "alibi_.logits_scale(1.f)" in both
    chain = both[both.index("logits_transform("):]
    assert chain.index("softcap_.logits_transform") < chain.index("logit *= softcap_.logits_scale(sm_scale);") \
        < chain.index("sm_scale = 1.f;") < chain.index("alibi_.logits_transform")
    head = attnjit.Variant("hs", params={"g": float}, logits_transform="return logit * g;")
    last = _variant_struct(V.compose(head, V.SOFTCAP))
    assert "HAS_LOGITS_SCALE = true" in last and "logit *=" not in last and "softcap_.logits_scale(1.f)" in last
    assert "alibi_.logits_scale(sm_scale)" in _variant_struct(V.ALIBI)
    assert "HAS_LOGITS_SCALE = false" in _variant_struct(V.SIGMOID)


def test_softcap_leaves_its_cap_to_the_softmax():
    """cap * tanh(logit / cap) with the factor cap in the softmax's scale, |cap| both times (tanh is odd: the same
    function for a negative cap, and a positive scale)."""
    assert V.SOFTCAP.hook("logits_scale") == "return fabsf(logits_soft_cap);"
    assert "logits_soft_cap *" not in V.SOFTCAP.hook("logits_transform")
    assert "fabsf(logits_soft_cap)" in V.SOFTCAP.hook("logits_transform")


@pytest.mark.nvcc
def test_sm90_softcap_loop_costs_a_multiply_and_a_tanh_a_logit():
    """With the cap folded into the softmax's scale the soft-cap adds to the default loop one FMUL (q.k times
    sm_scale / cap) and one MUFU (tanh) for each of a consumer thread's 64 logits, no more."""
    from benchmarks import sm90_sass as ss

    base = ss.analyze(ss.sass_of(ss.spec_for()))["loop"]["opcodes"]
    cap = ss.analyze(ss.sass_of(dataclasses.replace(ss.spec_for(), variant=V.SOFTCAP)))["loop"]["opcodes"]
    assert cap["MUFU"] - base["MUFU"] == 64, (base, cap)
    assert cap["FMUL"] - base["FMUL"] == 64, (base, cap)


@pytest.mark.nvcc
def test_sm90_alibi_loop_costs_an_add_and_a_fused_multiply_add_a_logit():
    """ALiBi adds slope / sm_scale * rel_pos to the unscaled q.k and leaves sm_scale to the softmax: one FADD (rel_pos)
    and one FFMA for each of a consumer thread's 64 logits over the default loop, no FMUL, no exponential more."""
    from benchmarks import sm90_sass as ss

    base = ss.analyze(ss.sass_of(ss.spec_for()))["loop"]["opcodes"]
    alibi = ss.analyze(ss.sass_of(dataclasses.replace(ss.spec_for(), variant=V.ALIBI)))["loop"]["opcodes"]
    assert alibi["MUFU"] - base["MUFU"] <= 2, (base, alibi)      # __fdividef's reciprocal, once a row
    assert alibi["FMUL"] - base["FMUL"] <= 8, (base, alibi)      # a row's slope / sm_scale, not a logit's multiply
    extra = sum(alibi.values()) - sum(base.values())
    assert extra <= 2 * 64 + 16, (extra, base, alibi)
