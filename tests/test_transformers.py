"""attnjit as a transformers attention backend (issue 13 item 3), on the CPU: the integration's plumbing (layouts,
GQA, causal and sliding-window options, soft-cap, scaling, explicit masks for padding, the KV cache of generate())
with the float64 reference backend, against transformers' own eager attention. tests/gpu/test_transformers.py runs
the kernels against "sdpa"."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnjit.integrations.transformers as attnjit_hf  # noqa: E402

NAME = attnjit_hf.register("attnjit_reference", backend="reference")
COMMON = dict(vocab_size=97, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=256)


def configs():
    return {
        "llama": transformers.LlamaConfig(**COMMON),
        "qwen2": transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                          layer_types=["full_attention", "sliding_attention"]),
        "mistral": transformers.MistralConfig(**COMMON, sliding_window=5),
        "gemma2": transformers.Gemma2Config(**COMMON, head_dim=64, sliding_window=5, attn_logit_softcapping=2.0,
                                            final_logit_softcapping=None, query_pre_attn_scalar=48),
    }


def model(kind: str, impl: str, seed: int = 0):
    """A randomly initialized model of the kind (the same weights for every impl with the same seed)."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(configs()[kind], attn_implementation=impl).eval()


@pytest.fixture
def calls(monkeypatch):
    """Each reference call's options: (causal, window, softcap, scale, explicit mask?)."""
    seen = []
    original = attnjit_hf._reference

    def spy(q, k, v, **kw):
        seen.append((kw["causal"], kw["window"], kw["softcap"], kw["scale"], kw["visible"] is not None))
        return original(q, k, v, **kw)
    monkeypatch.setattr(attnjit_hf, "_reference", spy)
    return seen


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma2"])
def test_logits_match_eager(kind, calls):
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(kind, "eager")(ids).logits
        got = model(kind, NAME)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert calls and all(c[0] and not c[4] for c in calls), calls   # no padding: causal, no explicit mask
    windows = {c[1] for c in calls}
    assert windows == ({-1, 4} if kind in ("qwen2", "gemma2") else {4} if kind == "mistral" else {-1}), windows
    if kind == "gemma2":
        assert {c[2] for c in calls} == {2.0} and {c[3] for c in calls} == {48 ** -0.5}


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_padded_batches_run_with_an_explicit_mask(kind, calls):
    """Left padding: the mask comes as an explicit boolean mask (a custom mask for the kernels); the rows that are
    not padding match eager."""
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(2))
    pad = torch.ones(2, 10, dtype=torch.long)
    pad[1, :3] = 0
    with torch.no_grad():
        want = model(kind, "eager")(ids, attention_mask=pad).logits
        got = model(kind, NAME)(ids, attention_mask=pad).logits
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], rtol=1e-4, atol=1e-4)
    assert calls and all(c[4] and not c[0] and c[1] == -1 for c in calls), calls


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_greedy_generation_with_the_kv_cache_matches_eager(kind, calls):
    """generate(): a prefill, then one-token decode steps over a growing DynamicCache (queries at the end of the
    keys: the causal path, no explicit mask)."""
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model(kind, "eager").generate(ids, **kw)
        got = model(kind, NAME).generate(ids, **kw)
    assert torch.equal(got, want)
    assert any(c[0] and not c[4] for c in calls)


def test_the_mask_function_skips_only_what_causal_and_the_window_give():
    kw = dict(batch_size=1, q_length=3, kv_length=8, mask_function=transformers.masking_utils.causal_mask_function)
    assert attnjit_hf.build_mask(**kw, q_offset=5, kv_offset=0) is None          # decode / chunk: bottom-right
    explicit = attnjit_hf.build_mask(**kw, q_offset=0, kv_offset=0)              # top-left (a static cache)
    assert explicit is not None and explicit.dtype == torch.bool and explicit.shape == (1, 1, 3, 8)
    assert attnjit_hf.build_mask(**kw, q_offset=5, kv_offset=0, allow_is_causal_skip=False) is not None
    padded = torch.ones(1, 8, dtype=torch.bool)
    assert attnjit_hf.build_mask(**kw, q_offset=5, kv_offset=0, attention_mask=padded) is None
    padded[0, 0] = False
    assert attnjit_hf.build_mask(**kw, q_offset=5, kv_offset=0, attention_mask=padded) is not None


def test_what_the_kernels_cannot_run_is_a_named_error():
    q = torch.zeros(1, 2, 3, 64)
    k = torch.zeros(1, 1, 3, 64)
    with pytest.raises(NotImplementedError, match="per batch element"):
        attnjit_hf.attention_forward(torch.nn.Module(), q, k, k, torch.ones(1, 2, 3, 3, dtype=torch.bool),
                                     backend="reference")
    bias = torch.zeros(1, 1, 3, 3)
    bias[0, 0, 0, 0] = 0.5
    with pytest.raises(NotImplementedError, match="additive attention masks with a bias"):
        attnjit_hf.attention_forward(torch.nn.Module(), q, k, k, bias, backend="reference")
    training = torch.nn.Module().train()
    with pytest.raises(NotImplementedError, match="attention dropout=0.1 in training"):
        attnjit_hf.attention_forward(training, q, k, k, None, dropout=0.1, backend="reference")
    with pytest.raises(ValueError, match="backend='cuda' is not supported"):
        attnjit_hf.register("x", backend="cuda")
