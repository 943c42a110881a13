"""A Llama-architecture decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP) whose attention runs over a paged KV
cache through FlashInfer-style wrappers: attnjit's, FlashInfer's or the float64 reference, at the same call sites.

The math follows Hugging Face transformers' ``LlamaForCausalLM`` (default RoPE, no biases, untied embeddings), so
the same weights give the same logits; ``LlamaWeights.from_hf`` copies them from such a model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")

    @classmethod
    def llama3_8b(cls, num_layers: int = 32) -> LlamaConfig:
        """Llama-3-8B's shapes (optionally fewer layers)."""
        return cls(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=num_layers, num_heads=32,
                   num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5)

    @classmethod
    def tiny(cls, **overrides) -> LlamaConfig:
        """A small model for tests: GQA group 4, head_dim 128 (the shapes the kernels ship)."""
        base = cls(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=4,
                   num_kv_heads=1, head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-5)
        return replace(base, **overrides)

    def to_hf(self):
        """The matching ``transformers.LlamaConfig`` (transformers is an optional dependency: the ``model``
        extra)."""
        from transformers import LlamaConfig as HFConfig
        return HFConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                        intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                        num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                        head_dim=self.head_dim, rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
                        max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False,
                        mlp_bias=False, hidden_act="silu")


@dataclass(kw_only=True)
class LayerWeights:
    qkv: torch.Tensor      # [(H_q + 2 H_kv) D, hidden]: q_proj, k_proj, v_proj stacked
    o: torch.Tensor        # [hidden, H_q D]
    gate_up: torch.Tensor  # [2 I, hidden]: gate_proj, up_proj stacked
    down: torch.Tensor     # [hidden, I]
    ln1: torch.Tensor      # [hidden] input_layernorm
    ln2: torch.Tensor      # [hidden] post_attention_layernorm


@dataclass(kw_only=True)
class LlamaWeights:
    embed: torch.Tensor    # [V, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor     # [hidden]
    lm_head: torch.Tensor  # [V, hidden]

    @classmethod
    def random(cls, config: LlamaConfig, *, dtype=torch.bfloat16, device="cuda", seed: int = 0,
               std: float = 0.02) -> LlamaWeights:
        """Random weights (normal, ``std``; norm weights 1 + 0.1 N(0, 1) so they matter)."""
        g = torch.Generator(device=device).manual_seed(seed)
        c = config

        def w(*shape, mean=0.0, s=std):
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * s + mean).to(dtype)

        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        layers = [LayerWeights(qkv=w(qkv_rows, c.hidden_size), o=w(c.hidden_size, c.num_heads * c.head_dim),
                               gate_up=w(2 * c.intermediate_size, c.hidden_size),
                               down=w(c.hidden_size, c.intermediate_size),
                               ln1=w(c.hidden_size, mean=1.0, s=0.1), ln2=w(c.hidden_size, mean=1.0, s=0.1))
                  for _ in range(c.num_layers)]
        return cls(embed=w(c.vocab_size, c.hidden_size), layers=layers, norm=w(c.hidden_size, mean=1.0, s=0.1),
                   lm_head=w(c.vocab_size, c.hidden_size))

    @classmethod
    def from_hf(cls, model, *, dtype=None, device=None) -> LlamaWeights:
        """Copy the weights of a transformers ``LlamaForCausalLM``."""
        def t(x):
            return x.detach().to(device=device, dtype=dtype).contiguous()

        m = model.model
        layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            layers.append(LayerWeights(
                qkv=t(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])), o=t(a.o_proj.weight),
                gate_up=t(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])), down=t(mlp.down_proj.weight),
                ln1=t(layer.input_layernorm.weight), ln2=t(layer.post_attention_layernorm.weight)))
        return cls(embed=t(m.embed_tokens.weight), layers=layers, norm=t(m.norm.weight), lm_head=t(model.lm_head.weight))

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The same weights under transformers' names (to build the matching ``LlamaForCausalLM``)."""
        sd = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm, "lm_head.weight": self.lm_head}
        for i, lw in enumerate(self.layers):
            p = f"model.layers.{i}."
            hq = lw.o.shape[1]
            hkv = (lw.qkv.shape[0] - hq) // 2
            q, k, v = lw.qkv.split([hq, hkv, hkv])
            g, u = lw.gate_up.chunk(2)
            sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                       p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": lw.o,
                       p + "mlp.gate_proj.weight": g, p + "mlp.up_proj.weight": u, p + "mlp.down_proj.weight": lw.down,
                       p + "input_layernorm.weight": lw.ln1, p + "post_attention_layernorm.weight": lw.ln2})
        return sd


def transformers_logits(config: LlamaConfig, weights: LlamaWeights, requests, device) -> dict[int, torch.Tensor]:
    """The float32 transformers ``LlamaForCausalLM`` with the same weights, on each finished request's prompt +
    generated tokens: {request id: float64 CPU logits [max_new_tokens, V]}, row i the logits that chose generated
    token i (teacher forcing on the request's own tokens; greedy decoding agrees with transformers exactly when
    every row's argmax is the token generated)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(config.to_hf()).to(device=device, dtype=torch.float32).eval()
    hf.load_state_dict({k: v.float() for k, v in weights.to_hf_state_dict().items()}, strict=True)
    out = {}
    with torch.no_grad():
        for r in requests:
            ids = torch.tensor([(r.prompt + r.generated)[:-1]], device=device)
            out[r.id] = hf(input_ids=ids).logits[0, len(r.prompt) - 1:].double().cpu()
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalize in float32, cast back, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class AttnMetadata:
    """Device int32 tensors of one step (the seed's contracts): the append's per-token request and position, and
    the page table after the append."""

    batch_indices: torch.Tensor    # [nnz]
    positions: torch.Tensor        # [nnz]
    kv_indptr: torch.Tensor        # [B + 1]
    kv_indices: torch.Tensor       # [>= kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # [B]


class PagedLlama:
    """The decoder over a paged KV cache ``[layers][pages, 2, page_size, H_kv, D]`` (NHD).

    ``dtype`` is the activation/weight type; ``attn_dtype`` the type of q, the KV cache and the attention output
    (fp16 or bf16, what the kernels take). A float32 model with an fp16 cache is how the tests compare against
    transformers in float32.
    """

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, *, ops, num_pages: int, page_size: int,
                 dtype: torch.dtype = torch.bfloat16, attn_dtype: torch.dtype | None = None, device="cuda"):
        self.config, self.w, self.ops = config, weights, ops
        self.dtype = dtype
        self.attn_dtype = attn_dtype or dtype
        self.device = torch.device(device)
        self.page_size = page_size
        c = config
        self.kv_cache = torch.zeros(c.num_layers, num_pages, 2, page_size, c.num_kv_heads, c.head_dim,
                                    dtype=self.attn_dtype, device=self.device)
        self.layer_caches = [self.kv_cache[i] for i in range(c.num_layers)]  # fixed views (wrappers memoize them)
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64, device=self.device)
                                                .float() / c.head_dim))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [nnz] -> cos, sin [nnz, 1, D] in the model dtype (transformers: float32 math, then cast)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    def forward(self, token_ids: torch.Tensor, meta: AttnMetadata, attention,
                logit_rows: torch.Tensor | None) -> torch.Tensor:
        """token_ids [nnz] -> logits [rows, V] (float32) of ``logit_rows`` (all rows when None). ``attention`` is a
        planned wrapper; each layer appends its K/V to the cache, then runs it."""
        c, w = self.config, self.w
        n = token_ids.shape[0]
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        h = F.embedding(token_ids, w.embed)
        cos, sin = self.rope(meta.positions)
        for i, lw in enumerate(w.layers):
            x = rms_norm(h, lw.ln1, c.rms_norm_eps)
            q, k, v = (x @ lw.qkv.T).split([hq * d, hkv * d, hkv * d], dim=-1)
            q = q.view(n, hq, d)
            k = k.view(n, hkv, d)
            q = (q * cos + rotate_half(q) * sin).to(self.attn_dtype)
            k = (k * cos + rotate_half(k) * sin).to(self.attn_dtype)
            v = v.view(n, hkv, d).to(self.attn_dtype)
            cache = self.layer_caches[i]
            self.ops.append_paged_kv_cache(k, v, meta.batch_indices, meta.positions, cache, meta.kv_indices,
                                           meta.kv_indptr, meta.kv_last_page_len, "NHD")
            o = attention.run(q, cache)
            h = h + o.reshape(n, hq * d).to(self.dtype) @ lw.o.T
            x = rms_norm(h, lw.ln2, c.rms_norm_eps)
            gate, up = (x @ lw.gate_up.T).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ lw.down.T
        if logit_rows is not None:
            h = h.index_select(0, logit_rows)
        return (rms_norm(h, w.norm, c.rms_norm_eps) @ w.lm_head.T).float()
