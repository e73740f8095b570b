"""Growing a trained model's width by unit duplication (Net2WiderNet), computing the same function.

``grow_width(model, factor)`` returns a model ``factor`` times as wide (hidden size, attention heads,
key/value heads and FFN units; the head size is kept) whose logits equal the narrow model's up to
float rounding. The demo target is trained narrow and served grown (engine/demo/recipe.py): it costs
what a model of the wide shape costs to run, for a fraction of the training compute.

Every wide unit is a copy of narrow unit ``j % n``. The residual stream becomes ``[x, x, ...]``,
whose RMS is that of ``x``: each RMSNorm gain is divided by ``factor``, so the Linears that read the
normalized stream (q/k/v, gate/up, the tied LM head) repeat their columns and sum the copies back to
the narrow product; o_proj and down_proj read ``factor`` copies of each head or FFN unit and repeat
their columns divided by ``factor``. Only powers of two are allowed, so the divisions are exact in any
float format and bf16-valued weights stay bf16-valued.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.core.config import ModelConfig
from engine.core.model import Transformer


def grown_config(cfg: ModelConfig, factor: int) -> ModelConfig:
    """The config of ``cfg`` grown ``factor`` times wider (head size unchanged)."""
    if factor < 1 or factor & (factor - 1):
        raise ValueError(f"factor={factor} is invalid: allowed a power of two")
    return replace(
        cfg,
        hidden_size=cfg.hidden_size * factor,
        intermediate_size=cfg.intermediate_size * factor,
        num_attention_heads=cfg.num_attention_heads * factor,
        num_key_value_heads=cfg.num_key_value_heads * factor,
    )


@torch.no_grad()
def grow_width(model: Transformer, factor: int) -> Transformer:
    """A ``factor`` times wider copy of ``model`` computing the same logits."""
    cfg = model.config
    if cfg.attention_bias or cfg.o_bias or cfg.mlp_bias or not cfg.tie_word_embeddings:
        raise ValueError("grow_width: allowed models without biases and with tied embeddings")
    wide = Transformer(grown_config(cfg, factor)).to(model.embed_tokens.weight.dtype)
    f = factor
    wide.embed_tokens.weight.copy_(model.embed_tokens.weight.repeat(1, f))  # residual stream [x, x, ...]
    for src, dst in zip(model.layers, wide.layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(dst, norm).weight.copy_(getattr(src, norm).weight.repeat(f) / f)
        a, b = src.self_attn, dst.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # input normalized (gain / f): columns repeated
            getattr(b, name).weight.copy_(getattr(a, name).weight.repeat(f, f))
        # o_proj reads f copies of every head (divide by f) and writes f copies of the stream
        b.o_proj.weight.copy_(a.o_proj.weight.repeat(f, f) / f)
        m, n = src.mlp, dst.mlp
        n.gate_proj.weight.copy_(m.gate_proj.weight.repeat(f, f))
        n.up_proj.weight.copy_(m.up_proj.weight.repeat(f, f))
        n.down_proj.weight.copy_(m.down_proj.weight.repeat(f, f) / f)
    wide.norm.weight.copy_(model.norm.weight.repeat(f) / f)  # the tied LM head reads [x, x, ...]
    wide.lm_head.weight = wide.embed_tokens.weight
    return wide.train(model.training)
