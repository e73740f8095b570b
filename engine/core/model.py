"""A Llama-family decoder in plain PyTorch (Llama 2/3, Mistral, Qwen2).

Module names match the Hugging Face checkpoints (without the ``model.`` prefix),
so loading is a rename and quantization is a module swap of ``nn.Linear``s:

    embed_tokens, layers[i].{input_layernorm, self_attn.{q,k,v,o}_proj,
    post_attention_layernorm, mlp.{gate,up,down}_proj}, norm, lm_head

The KV cache (engine/core/forward.py) is static and position-indexed (gpt-fast style): one tensor per
k/v of shape [layers, max_batch, kv_heads, max_seq_len, head_dim]. A forward
writes the new keys at ``input_pos`` and attends over the first ``kv_len``
slots with a position mask, so each sequence of a ragged batch has its own
length, and rolling a sequence back is just using a smaller position next time. The attention
backends and the position mask are in engine/core/attention.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.attention import AttentionBackend, AttentionContext, position_mask, sdpa_attention
from engine.core.config import ModelConfig
from engine.core.errors import InvalidConfigError
from engine.core.forward import Features, ForwardCall, ForwardOut, KVCache, StepKernel  # KVCache: also for importers
from engine.core.stored_linear import StoredLinear  # also for importers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # x * rsqrt(mean(x^2) + eps) in fp32, as HF Llama does, in one dispatch
        if x.dtype == torch.float32:
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with Llama-3 / linear scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if not s:
        return inv
    factor = float(s["factor"])
    if s["rope_type"] == "linear":
        return inv / factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate between
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_l)


def rope_cos_sin(inv_freq: Tensor, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """pos [B,T] -> cos [B,1,T,D] and the sign-folded sin [B,1,T,D]: (-sin, sin) over the two
    halves (D = 2 * len(inv_freq)), the form apply_rope takes."""
    freqs = pos.float()[..., None] * inv_freq  # [B,T,D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    sin = emb.sin()
    return emb.cos().to(dtype), torch.cat((-sin[..., : freqs.shape[-1]], sin[..., freqs.shape[-1] :]), -1).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin_folded: Tensor) -> Tensor:
    """x [B,H,T,D] rotated in the half-split (rotate_half) convention of HF Llama:
    x * cos + cat(-x2, x1) * sin == x * cos + roll(x, D/2) * (-sin, sin), bit for bit (a sign
    moved between the factors of a product is exact), in 4 ops instead of 8."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_folded


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.window = cfg.sliding_window
        self.q_proj = nn.Linear(h, self.n_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=cfg.o_bias)
        self.qkv: FusedLinear | None = None  # q/k/v as one GEMM (fuse_projections)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attn: AttentionBackend,
        cache: tuple[Tensor, Tensor] | None,
        ctx: AttentionContext,
    ) -> Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        if self.qkv is not None:  # one GEMM, one rotation for q and k together
            qkv = self.qkv(x).view(B, T, H + 2 * Hkv, D).transpose(1, 2)
            qk = apply_rope(qkv[:, : H + Hkv], cos, sin)
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]
        else:
            q = apply_rope(self.q_proj(x).view(B, T, H, D).transpose(1, 2), cos, sin)
            k = apply_rope(self.k_proj(x).view(B, T, Hkv, D).transpose(1, 2), cos, sin)
            v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        if cache is None:
            o = attn(q, k, v, ctx.mask, True)
        else:
            kc, vc = cache  # [max_batch, Hkv, S, D]
            if ctx.start is not None:  # rows 0..B-1 all write start..start+T-1: a slice copy
                kc[:B, :, ctx.start : ctx.start + T] = k
                vc[:B, :, ctx.start : ctx.start + T] = v
            else:  # advanced indices (rows [B,1], pos [B,T]) around a slice -> value [B,T,Hkv,D]
                assert ctx.rows is not None
                kc[ctx.rows[:, None], :, ctx.write_slots] = k.transpose(1, 2).to(kc.dtype)
                vc[ctx.rows[:, None], :, ctx.write_slots] = v.transpose(1, 2).to(vc.dtype)
            o = attn.with_cache(q, kc, vc, ctx, self.window)  # a backend that reads the cache in place
            if o is None:
                if ctx.rows_are_prefix or ctx.rows is None:
                    ks, vs = kc[:B, :, : ctx.kv_len], vc[:B, :, : ctx.kv_len]
                else:
                    ks, vs = kc[ctx.rows, :, : ctx.kv_len], vc[ctx.rows, :, : ctx.kv_len]
                o = attn(q, ks.to(q.dtype), vs.to(q.dtype), ctx.mask, False)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.gate_up: FusedLinear | None = None  # gate/up as one GEMM (fuse_projections)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedLinear:
    """Several Linears' outputs from one GEMM. Not a Module: the Linears keep the parameters (as views
    of ``weight``), so state_dict and checkpoints are unchanged. engine/kernels/cpu_linear.py packs it.
    A group of StoredLinears keeps their storage dtype; the weight is widened to the input's per call."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype), self.bias)


def _fuse(mods: tuple[nn.Module, ...]) -> FusedLinear | None:
    """One weight (and bias) stacking the Linears' outputs; each Linear's weight becomes a view of it,
    so no memory is added and the modules (names, state_dict) stay as the checkpoint has them.
    None when they are not all plain nn.Linear or all StoredLinear (a quantized or packed layer) or they
    differ in dtype, device or having a bias."""
    if len({type(m) for m in mods}) != 1 or type(mods[0]) not in (nn.Linear, StoredLinear):
        return None
    ws = [m.weight for m in mods]  # type: ignore[union-attr]
    bs = [m.bias for m in mods]  # type: ignore[union-attr]
    if len({(w.dtype, w.device) for w in ws}) != 1 or len({b is None for b in bs}) != 1:
        return None
    w = torch.cat([x.detach() for x in ws])
    b = None if bs[0] is None else torch.cat([x.detach() for x in bs])  # type: ignore[union-attr]
    rows = [x.shape[0] for x in ws]
    for m, part in zip(mods, w.split(rows)):
        m.weight = nn.Parameter(part, requires_grad=False)
    if b is not None:
        for m, part in zip(mods, b.split(rows)):
            m.bias = nn.Parameter(part, requires_grad=False)
    return FusedLinear(w, b)


def fuse_projections(model: nn.Module) -> int:
    """Run q/k/v as one GEMM and gate/up as one (inference only, after any quantization module swap:
    quantized layers are left alone). Per layer 3 GEMMs and their dispatch fewer, which is most of a
    small model's step on a CPU. ``model``: anything with ``layers`` of ``Block`` (a Transformer, the EAGLE head
    with attention). Returns the number of fused groups."""
    n = 0
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        if a.qkv is None:
            a.qkv = _fuse((a.q_proj, a.k_proj, a.v_proj))
        if m.gate_up is None:
            m.gate_up = _fuse((m.gate_proj, m.up_proj))
        n += (a.qkv is not None) + (m.gate_up is not None)
    return n


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attn: AttentionBackend,
        cache: tuple[Tensor, Tensor] | None,
        ctx: AttentionContext,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, cache, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.attn_fn: AttentionBackend = sdpa_attention
        self._rope: tuple[Tensor, Tensor] | None = None  # cos, sin [N, D] for positions 0..N-1
        self.layer_step: StepKernel | None = None  # the cached forward as one C++ call (engine/kernels/cpu_decode.py)
        self.feature_layers: tuple[int, ...] = ()  # use_feature_layers: what a forward's features are

    def use_kernels(self, attention: AttentionBackend | None = None, step: StepKernel | None = None) -> None:
        """The one hook for the kernels layer (engine/kernels/backends.py chooses them; the engine's builder
        calls this where it builds the model): ``attention`` replaces the attention backend when given;
        ``step`` runs every cached no-grad fp32 forward it takes in one call (None: PyTorch's layers)."""
        if attention is not None:
            self.attn_fn = attention
        self.layer_step = step

    def use_feature_layers(self, layers: tuple[int, ...]) -> None:
        """The hook for a drafter that reads several layers (EAGLE-3): with ``layers`` set, the features a forward
        returns (``ForwardCall.features``) are the hidden states entering those layers, concatenated in this
        order [..., len(layers) * H], captured in the same pass (on the step kernel where it takes the call);
        () restores the final-norm output."""
        n = self.config.num_hidden_layers
        if any(not 0 <= i < n for i in layers):
            raise InvalidConfigError(f"feature_layers={layers!r} is invalid: allowed layer indices 0..{n - 1}")
        self.feature_layers = tuple(layers)

    def reset_rope(self) -> None:
        """Recompute the rotary frequencies (after building on the meta device)."""
        self.inv_freq = rope_inv_freq(self.config).to(self.embed_tokens.weight.device)
        self._rope = None

    def rope_table(self, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [N, D] (N >= n) for positions 0..N-1: the same values rope_cos_sin computes."""
        t = self._rope
        if t is None or t[0].shape[0] < n or t[0].dtype != dtype or t[0].device != self.inv_freq.device:
            pos = torch.arange(max(n, self.config.max_position_embeddings), device=self.inv_freq.device)
            cos, sin = rope_cos_sin(self.inv_freq, pos[None], dtype)
            self._rope = t = (cos[0, 0], sin[0, 0])
        return t

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(
        self,
        tokens: Tensor,  # [B,T] int64
        input_pos: Tensor | None = None,  # [B,T] int64 positions; None -> 0..T-1
        cache: KVCache | None = None,
        kv_len: int | None = None,  # cache slots to attend over (> max position in the batch)
        rows: Tensor | None = None,  # [B] cache rows of the batch; None -> 0..B-1
        logits_idx: Tensor | None = None,  # [B] -> logits [B,V]; [B,J] -> [B,J,V]: positions to score
        n_layers: int | None = None,  # run only the first n layers (early-exit drafting)
        start: int | None = None,  # promise: rows is None and input_pos[b] == start..start+T-1 for every b
    ) -> Tensor:
        """Logits [B,T,V] (or only the positions in logits_idx). Without a cache: a plain causal forward.
        ``run`` takes the same as a ``ForwardCall`` and can return features too."""
        return self.run(ForwardCall(tokens, input_pos, cache, kv_len, rows, logits_idx, n_layers, start)).logits

    def run(self, call: ForwardCall) -> ForwardOut:
        """The forward of ``call``: on the step kernel where it takes the call, else PyTorch's layers.

        ``start`` lets the cache path skip index scatters and gathers: the new keys go in with a
        slice copy, the rotary table is sliced, and a single-token step needs no mask.
        """
        step = self.layer_step
        aux = self.feature_layers if call.features is not Features.NONE else ()
        if call.cache is not None and step is not None and step.takes(call):
            assert call.kv_len is not None, "kv_len is required with a cache"
            return step.run(call, aux)
        if call.rows is not None and call.rows.dim() == 2:
            raise ValueError("a cache row per token runs on the step kernel only (see packs())")
        x = self.embed_tokens(call.tokens)
        cos, sin, ctx = self._context(call, x.dtype)
        layers = self.layers if call.n_layers is None else self.layers[: call.n_layers]
        captured: dict[int, Tensor] = {}
        for i, layer in enumerate(layers):
            if i in aux:
                captured[i] = x
            c = None if call.cache is None else (call.cache.k[i], call.cache.v[i])
            x = layer(x, cos, sin, self.attn_fn, c, ctx)
        if aux:  # the hidden states entering the feature layers (EAGLE-3), the scored ones or all
            h = torch.cat([captured[i] for i in aux], -1)
            logits = self.lm_head(self.norm(_scored(x, call.logits_idx)))
            return ForwardOut(logits, h if call.features is Features.ALL else _scored(h, call.logits_idx))
        if call.features is Features.ALL:
            h = self.norm(x)
            return ForwardOut(self.lm_head(_scored(h, call.logits_idx)), h)
        h = self.norm(_scored(x, call.logits_idx))
        return ForwardOut(self.lm_head(h), h if call.features is Features.SCORED else None)

    def packs(self, cache: KVCache) -> bool:
        """Whether a call over ``cache`` with a cache row per token (``ForwardCall.rows`` [B, T]) runs here: on the
        step kernel (PyTorch's layers gather a sequence's cache per row of the batch)."""
        step = self.layer_step
        return step is not None and step.takes(ForwardCall(torch.zeros(1, 1, dtype=torch.long), cache=cache))

    def greedy_draft(self, call: ForwardCall, last: Tensor, steps: int, vocab: int) -> Tensor | None:
        """``steps`` greedy drafts in one call (``StepKernel.greedy``) where the step kernel takes ``call``;
        None: the caller runs the steps."""
        step = self.layer_step
        if call.cache is None or step is None or not step.takes(call):
            return None
        return step.greedy(call, last, steps, vocab)

    def _context(self, call: ForwardCall, dtype: torch.dtype) -> tuple[Tensor, Tensor, AttentionContext]:
        """The rotary tables of the call's positions and the attention context its layers share."""
        B, T = call.tokens.shape
        dev, window = call.tokens.device, self.config.sliding_window
        pos = call.pos if call.pos is not None else torch.arange(T, device=dev).expand(B, T)
        if call.cache is None:
            cos, sin = rope_cos_sin(self.inv_freq, pos, dtype)
            mask = position_mask(pos, T, window) if window is not None and window < T else None
            return cos, sin, AttentionContext(pos, None, True, T, mask)
        kv_len = call.kv_len
        assert kv_len is not None, "kv_len is required with a cache"
        cos_t, sin_t = self.rope_table(call.cache.max_seq_len, dtype)
        if call.tree is not None:  # nodes at depth-based positions, each in its own slot, the tree's mask
            if window is not None:
                raise InvalidConfigError("draft trees are not verified for a sliding-window model: propose chains")
            rows = torch.arange(B, device=dev) if call.rows is None else call.rows
            tree = AttentionContext(pos, rows, call.rows is None, kv_len, call.tree.mask, slots=call.tree.slots)
            return cos_t[pos][:, None], sin_t[pos][:, None], tree
        start = call.start
        if start is not None:
            assert call.rows is None and kv_len == start + T, "start needs rows=None and kv_len == start + T"
            # one query that sees every key needs no mask; a block gets its mask built once here,
            # shared by every layer (not rebuilt by the attention function in each of them)
            full = T == 1 and (window is None or kv_len <= window)
            mask = None if full else position_mask(pos, kv_len, window)
            ctx = AttentionContext(pos, None, True, kv_len, mask, start)
            return cos_t[None, None, start : start + T], sin_t[None, None, start : start + T], ctx
        prefix = call.rows is None
        rows = torch.arange(B, device=dev) if call.rows is None else call.rows
        ctx = AttentionContext(pos, rows, prefix, kv_len, position_mask(pos, kv_len, window))
        return cos_t[pos][:, None], sin_t[pos][:, None], ctx


def _scored(x: Tensor, idx: Tensor | None) -> Tensor:
    """x [B,T,...] at the positions idx [B] -> [B,...] or [B,J] -> [B,J,...]; None: x."""
    if idx is None:
        return x
    b = torch.arange(x.shape[0], device=x.device)
    return x[b, idx] if idx.dim() == 1 else x[b[:, None], idx]
