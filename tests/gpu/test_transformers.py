"""attnjit as transformers' attention (issue 13 item 3) on the GPU: Llama, Qwen2 and Mistral (sliding windows) against
attn_implementation="sdpa", Gemma-2 (soft-cap, sliding windows) against "eager" (sdpa has no soft-cap): logits within
bf16 tolerance, greedy tokens equal (a token may differ only where the reference's top two are tied within the
tolerance), and padded batches (explicit masks) equal on the rows that are not padding.

Specs: cases.TRANSFORMERS_SPECS (head_dim 64, 4 q heads over 2 KV heads, bf16), in specs/gpu-tests.toml.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnjit.integrations.transformers as attnjit_hf  # noqa: E402

DEV = "cuda"
NAME = attnjit_hf.register()
COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024)
REFERENCE = {"llama": "sdpa", "qwen2": "sdpa", "mistral": "sdpa", "gemma2": "eager"}
LOGIT_REL_TOL = 5e-2      # ||logits - ref|| / ||ref||, bf16 attention over 4 layers
TIE = 5e-2                # top-2 logit margin (relative to the logits' spread) below which a token may differ


def configs():
    return {
        "llama": transformers.LlamaConfig(**COMMON),
        "qwen2": transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=32, max_window_layers=2,
                                          layer_types=["full_attention", "sliding_attention"] * 2),
        "mistral": transformers.MistralConfig(**COMMON, sliding_window=32),
        "gemma2": transformers.Gemma2Config(**COMMON, head_dim=64, sliding_window=32, attn_logit_softcapping=20.0,
                                            final_logit_softcapping=None, query_pre_attn_scalar=64),
    }


def model(kind: str, impl: str):
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(configs()[kind], attn_implementation=impl,
                                                      dtype=torch.bfloat16)
    return m.to(DEV).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kind", list(REFERENCE))
def test_logits_match(kind):
    ids = torch.randint(0, 512, (3, 100), generator=torch.Generator().manual_seed(1)).to(DEV)
    with torch.no_grad():
        want = model(kind, REFERENCE[kind])(ids).logits
        got = model(kind, NAME)(ids).logits
    assert torch.isfinite(got).all()
    assert _rel(got, want) < LOGIT_REL_TOL, f"relative logit error {_rel(got, want):.3e}"


@pytest.mark.parametrize("kind", list(REFERENCE))
def test_greedy_tokens_match(kind):
    """attnjit generates (a prefill, then decode steps over the DynamicCache); the reference model, fed the same
    tokens, must pick the same ones wherever its choice is not a near-tie."""
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(2)).to(DEV)
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model(kind, NAME).generate(ids, **kw)
        ref_logits = model(kind, REFERENCE[kind])(got).logits[:, ids.shape[1] - 1:-1].float()
    chosen = got[:, ids.shape[1]:]
    top2 = ref_logits.topk(2, dim=-1).values
    spread = ref_logits.std()
    tie = (top2[..., 0] - top2[..., 1]) < TIE * spread
    agree = ref_logits.argmax(-1) == chosen
    assert (agree | tie).all(), f"tokens differ where the reference is not tied: {(~agree & ~tie).sum().item()}"
    assert agree.float().mean().item() > 0.9


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_padded_batches_match(kind):
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(3)).to(DEV)
    pad = torch.ones(2, 64, dtype=torch.long, device=DEV)
    pad[1, :17] = 0
    with torch.no_grad():
        want = model(kind, REFERENCE[kind])(ids, attention_mask=pad).logits
        got = model(kind, NAME)(ids, attention_mask=pad).logits
    assert _rel(got[0], want[0]) < LOGIT_REL_TOL and _rel(got[1, 17:], want[1, 17:]) < LOGIT_REL_TOL
