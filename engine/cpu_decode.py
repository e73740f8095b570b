"""A fp32 model's decoder layers as one C++ call for the few rows of a step (engine/csrc/decode_layers.cpp).

Why: a small model's step on a CPU is mostly PyTorch dispatch, not arithmetic. The demo draft's
two layers cost ~0.9 ms through ~45 PyTorch ops, of which the GEMMs are ~0.2 ms; the demo target
spends ~1 ms of its ~5.5 ms step outside its GEMMs. ``DecodeLayers`` runs the same layers
(RMSNorm, fused q/k/v, rotary, the static KV cache, causal attention, o_proj, RMSNorm, fused gate/up,
SiLU, down) in one call, with the small-GEMM kernel for every projection; embedding, final norm and
LM head stay in PyTorch. ``Transformer.forward`` uses it when installed (``model.layer_step``), for
calls with a cache, no autograd and at most ``MAX_ROWS`` rows; the PyTorch layers are its fallback
with the same inputs and outputs (tests run both and compare).

Every row is computed the same way whatever the number of rows in the call (the GEMM kernel is
row-independent and each query's attention is its own loop), so a verify pass and the one-token
steps agree bit for bit.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from .cpu_gemm import MAX_ROWS, _build, small_gemm_status
from .errors import KernelUnavailableError
from .model import FusedLinear, KVCache, Transformer, sdpa_attention

log = logging.getLogger(__name__)


def _plain_weight(mod: Any) -> bool:
    """An unquantized fp32 CPU projection: nn.Linear, a fused group or their small-GEMM forms."""
    from .cpu_gemm import SmallGemmLinear

    if not (type(mod) in (nn.Linear, SmallGemmLinear) or isinstance(mod, FusedLinear)):
        return False
    w = mod.weight
    return w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous() and (
        mod.bias is None or mod.bias.dtype == torch.float32)


def decode_layers_reason(model: Transformer) -> str | None:
    """None when ``DecodeLayers`` can run this model's layers here, else why not."""
    if model.dtype != torch.float32 or model.norm.weight.device.type != "cpu":
        return f"needs a float32 model on the CPU (this one is {str(model.dtype).replace('torch.', '')} on " \
               f"{model.norm.weight.device.type})"
    if model.attn_fn is not sdpa_attention:
        return f"the model's attention backend is {getattr(model.attn_fn, '__name__', model.attn_fn)!r}, not sdpa"
    cfg = model.config
    if cfg.num_attention_heads % cfg.num_key_value_heads or cfg.head_dim % 2:
        return "needs heads divisible by kv heads and an even head_dim"
    for i, layer in enumerate(model.layers):
        a, m = layer.self_attn, layer.mlp
        parts = {"qkv": a.qkv, "o_proj": a.o_proj, "gate_up": m.gate_up, "down_proj": m.down_proj}
        for name, mod in parts.items():
            if mod is None or not _plain_weight(mod):
                return (f"layer {i} {name} is not a plain fp32 projection ({type(mod).__name__}: quantized, or "
                        "q/k/v and gate/up not fused by fuse_projections)")
        if m.gate_up.bias is not None:  # type: ignore[union-attr]
            return f"layer {i} gate_up has a bias"
    return small_gemm_status()


class DecodeLayers:
    """``model``'s decoder layers as one C++ call (same inputs and result as its PyTorch layers)."""

    max_rows = MAX_ROWS

    def __init__(self, model: Transformer) -> None:
        reason = decode_layers_reason(model)
        if reason is not None:
            raise KernelUnavailableError(f"the fp32 decode-layers kernel cannot run this model: {reason}")
        mod, _ = _build()
        self.kernel = mod.decode_layers
        self.model = model
        self.weights: list[Tensor] = []
        empty = torch.empty(0)
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            for t in (layer.input_layernorm.weight, a.qkv.weight, a.qkv.bias, a.o_proj.weight, a.o_proj.bias,
                      layer.post_attention_layernorm.weight, m.gate_up.weight, m.down_proj.weight,
                      m.down_proj.bias):
                self.weights.append(empty if t is None else t.detach())
        cfg = model.config
        self.heads, self.kv_heads, self.eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
        self.window = cfg.sliding_window or 0

    def takes(self, x: Tensor, cache: KVCache) -> bool:
        """Whether this call (x [B,T,H]) goes through the kernel: few rows, a fp32 cache, no autograd."""
        return (x.shape[0] * x.shape[1] <= self.max_rows and cache.k.dtype == torch.float32
                and not (torch.is_grad_enabled() and x.requires_grad))

    def __call__(self, x: Tensor, pos: Tensor, rows: Tensor | None, cache: KVCache, kv_len: int,
                 n_layers: int | None) -> Tensor:
        """x [B,T,H] embedded tokens, pos [B,T] positions, rows [B] cache rows (None: 0..B-1) -> [B,T,H]."""
        B, T, H = x.shape
        n = len(self.model.layers) if n_layers is None else n_layers
        cos, sin = self.model.rope_table(cache.max_seq_len, torch.float32)
        row = torch.arange(B) if rows is None else rows
        out = x.reshape(B * T, H).clone()
        self.kernel(out, pos.reshape(-1).contiguous(), row.repeat_interleave(T) if T > 1 else row.contiguous(),
                    kv_len, self.weights[: 9 * n], cache.k, cache.v, cos, sin, self.heads, self.kv_heads,
                    self.window, self.eps)
        return out.view(B, T, H)


def install_decode_layers(model: Transformer) -> str | None:
    """Run ``model``'s few-row forwards through ``DecodeLayers``; None when installed, else why not (logged)."""
    reason = decode_layers_reason(model)
    if reason is not None:
        log.info("decoder layers stay on PyTorch: %s", reason)
        model.layer_step = None
        return reason
    model.layer_step = DecodeLayers(model)
    return None
