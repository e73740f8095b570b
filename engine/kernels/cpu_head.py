"""A trained draft head's step on the CPU's few-row kernels (engine/kernels/csrc/head_step.cpp, cpu_gemm.py).

Why: a head's step is a few GEMMs on one row per sequence around ~20 small ops. On PyTorch each small
op costs tens of microseconds on this kind of CPU and the fp32 linear streams the weights at about half
the kernel's rate, so the dispatch, not the head's size, set its cost (docs/performance.md has the figures).

- eagle: ``EagleKernel`` runs the whole step (the embedding's norm, fc, the MLP blocks, the output norm
  and the scores) as one C++ call, and ``greedy`` drafts k tokens in one call with no Python between the
  steps. The head's GEMM weights are 16-bit copies (the head is the draft: rounding its weights moves only
  the acceptance, as for a draft model's C++ step; a weight-only FP8 Linear's dequantized once,
  ``head_gemm_weight``; a native FP8 one keeps the head on PyTorch); the LM head's rows and the embedding stay
  the target's weights in the verifier's precision (fp32, or a CPU plan's fp16, widened exactly; shared when the
  head scores the full vocabulary).
- medusa: ``MedusaKernel`` runs the first n heads' blocks and scores in one call, and ``greedy`` returns
  their argmaxes (16-bit copies of the stacked head weights, the LM head's rows as the target stores them).
- eagle with attention: ``AttnHeadKernel`` runs the decoder layers, output norm and scores on the drafter's
  entries through the decode step's kernel (its ``forward_x``), with the head's own KV cache.
- eagle3: ``Eagle3HeadKernel`` runs EAGLE-3's layer (q/k/v over [norm(e); norm(f)], f the residual), its norm
  and its own LM head through the same kernel (``forward_pair``), returning the layer's output before the norm.
``scorer_on_kernel`` puts the PyTorch steps' scorer (the LM head's rows) on the few-row GEMM, same weight (fp32,
or a CPU plan's fp16 LM head).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from engine.core.config import ModelConfig
from engine.core.forward import TreeMask
from engine.core.model import RMSNorm, StoredLinear, rope_cos_sin
from engine.kernels.cpu_fp8 import fp8_reason, fp8_weight
from engine.kernels.cpu_gemm import SmallGemmLinear, cpu_kernels, small_gemm_reads, small_gemm_status
from engine.kernels.step_weights import WEIGHT_DTYPES, layer_weights, step_weight_dtype
from quant.linear import FP8Linear

log = logging.getLogger(__name__)


def _fp32_cpu(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


def head_store_dtype(weights: list[Tensor], store: str | torch.dtype | None) -> torch.dtype:
    """The dtype of a head's kernel weight copies: ``store`` by name or dtype; None or "auto": bfloat16 or
    float16 where every value of ``weights`` has that dtype (lossless), else float16 (the draft model's rule,
    ``step_weight_dtype``)."""
    dtype = step_weight_dtype(weights, "auto" if store is None else store)
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"store={store!r} is invalid: allowed auto, {', '.join(map(str, WEIGHT_DTYPES))}")
    return dtype  # type: ignore[return-value]


def head_gemm_weight(mod: nn.Module) -> Tensor | None:
    """A head Linear's weight as its C++ step reads it (the step keeps a 16-bit copy): a plain Linear's, or a
    weight-only FP8 Linear's dequantized (fp32, transient: as the draft model's step, only the acceptance can move);
    None for one the step does not compute (a native FP8 Linear scales its activations per token)."""
    if type(mod) is nn.Linear:
        return mod.weight
    if isinstance(mod, FP8Linear) and fp8_reason(mod) is None and mod.bias is None:
        return fp8_weight((mod,))
    return None


def head_kernel_reason(tensors: list[Tensor | None], shared: list[Tensor]) -> str | None:
    """None when a head's C++ step can run here on ``tensors`` (the head's own, as its ``kernel_weights`` gives
    them) and ``shared`` (the target's it reads: the LM head's rows, eagle's embedding), else why not."""
    why = small_gemm_status()
    if why is not None:
        return why
    if any(t is None for t in tensors):
        return "the head's Linears are FP8 with activation scaling (the plan's native kernel): they run on PyTorch"
    if not all(_fp32_cpu(t) for t in tensors if t is not None):
        return "needs the head's tensors in float32 on the CPU"
    if not all(t.device.type == "cpu" and t.dtype in WEIGHT_DTYPES and t.is_contiguous() for t in shared):
        return "needs the target's LM head rows and embedding contiguous on the CPU in float32, float16 or bfloat16"
    return None


class EagleKernel:
    """An EAGLE-style head's step in one C++ call; ``__call__`` has the signature of the drafter's ``step``,
    ``greedy`` drafts k tokens in one call."""

    def __init__(
        self,
        weights: list[Tensor],
        embed: Tensor,
        lm_weight: Tensor,
        vocab_ids: Tensor | None,
        eps: float,
        store: torch.dtype,
    ) -> None:
        """``weights``: the head's own tensors in the kernel's order (engine/spec_decode/heads/modules.py
        ``EagleHead.kernel_weights``: embed_norm, fc, per block norm, gate_up, down, then out_norm; 2-D ones are
        GEMM weights, copied to ``store``); ``embed`` the target's embedding [V, H], ``lm_weight`` the LM head's
        rows [V', H] (shared; fp32 or 16-bit as the target stores them), ``vocab_ids`` [V'] or None."""

        def own(t: Tensor) -> Tensor:  # a GEMM weight: a copy in ``store``; a norm weight: itself
            return t.detach().to(store).contiguous() if t.dim() == 2 else t.detach().contiguous()

        ws = [embed.detach().contiguous(), *map(own, weights[:-1])]
        ws += [weights[-1].detach().contiguous(), lm_weight.detach().contiguous()]
        ws.append(torch.empty(0, dtype=torch.long) if vocab_ids is None else vocab_ids.long().contiguous())
        self.impl = cpu_kernels().EagleStep(ws, eps)

    def __call__(self, f: Tensor, tok: Tensor) -> tuple[Tensor, Tensor]:
        """(features [B, H], the tokens they precede [B]) -> (the next features, their logits [B, V'])."""
        return self.impl.step(f.float().contiguous(), tok.long().contiguous())

    def greedy(self, f: Tensor, tok: Tensor, k: int) -> Tensor:
        """k greedy drafts from (features [B, H], tokens [B]) -> [B, k] ids of the full vocabulary."""
        return self.impl.greedy(f.float().contiguous(), tok.long().contiguous(), k)


class MedusaKernel:
    """Medusa heads' step in one C++ call; ``__call__`` has the drafter's ``step`` signature, ``greedy`` the first n
    heads' argmaxes in one call."""

    def __init__(
        self, weight: Tensor, bias: Tensor, lm_weight: Tensor, vocab_ids: Tensor | None, vocab: int, store: torch.dtype
    ) -> None:
        """``weight`` [L, M, H, H] (copied to ``store``), ``bias`` [L, M, H], ``lm_weight`` the LM head's rows
        [V', H] (shared; fp32 or 16-bit), ``vocab_ids`` [V'] or None, ``vocab`` the target's vocabulary size."""
        ids = torch.empty(0, dtype=torch.long) if vocab_ids is None else vocab_ids.long().contiguous()
        w = weight.detach().to(store).contiguous()
        self.impl = cpu_kernels().MedusaStep(w, bias.detach().contiguous(), lm_weight.detach().contiguous(), ids, vocab)

    def __call__(self, f: Tensor, n: int) -> Tensor:
        """Features [B, H] -> the first n heads' logits [B, n, V']."""
        return self.impl.step(f.float().contiguous(), n)

    def greedy(self, f: Tensor, n: int) -> Tensor:
        """Features [B, H] -> the first n heads' greedy drafts [B, n], ids of the full vocabulary."""
        return self.impl.greedy(f.float().contiguous(), n)


def scorer_on_kernel(scorer: nn.Linear | StoredLinear) -> nn.Module:
    """The LM head's scorer (engine/spec_decode/heads/modules.py ``draft_lm_head``) on the few-row GEMM, same
    weight (fp32, or a CPU plan's fp16 LM head)."""
    if type(scorer) in (nn.Linear, StoredLinear) and small_gemm_reads(scorer.weight) and small_gemm_status() is None:
        return SmallGemmLinear(scorer)
    return scorer


class Eagle3MidLayer(Protocol):
    """EAGLE-3's decoder layer as its kernel reads it (engine/spec_decode/heads/eagle3.py ``Eagle3Layer``)."""

    @property
    def post_attention_layernorm(self) -> RMSNorm:
        """The norm before its MLP."""
        ...

    def inputs(self, f: Tensor, e: Tensor) -> tuple[Tensor, Tensor]:
        """(features f, embeddings e [..., H]) -> (its q/k/v input [..., 2H], the residual [..., H])."""
        ...


class Eagle3Layers(Protocol):
    """An EAGLE-3 head as its kernel reads it (engine/spec_decode/heads/eagle3.py)."""

    @property
    def mcfg(self) -> ModelConfig:
        """The shape of its decoder layer."""
        ...

    @property
    def midlayer(self) -> Eagle3MidLayer:
        """Its decoder layer."""
        ...

    @property
    def norm(self) -> RMSNorm:
        """Its output norm."""
        ...

    @property
    def inv_freq(self) -> Tensor:
        """Its rotary frequencies, fp32."""
        ...

    def kernel_weights(self, gemm: Callable[[nn.Module], Tensor | None]) -> list[Tensor | None]:
        """q, k, v, o, gate, up, down and the LM head's weights as ``gemm`` reads them (None: unreadable)."""
        ...


class AttnHeadLayers(Protocol):
    """The EAGLE head with attention as its kernel reads it (engine/spec_decode/heads/eagle_attn.py)."""

    mcfg: ModelConfig
    """The shape of its decoder layers."""
    layers: nn.ModuleList
    """Its decoder layers (the core model's ``Block``)."""
    out_norm: RMSNorm
    """Its output norm."""
    inv_freq: Tensor
    """Its rotary frequencies, fp32."""

    def kernel_weights(self, gemm: Callable[[nn.Module], Tensor | None]) -> list[Tensor | None]:
        """The GEMM weights a C++ step would copy, as ``gemm`` reads them (None: one the step cannot read)."""
        ...

    def entries(self, f: Tensor, e: Tensor) -> Tensor:
        """(features f, next tokens' embeddings e [..., H]) -> the decoder's inputs [..., H]."""
        ...


class RopeTable:
    """cos, sin [N, D] fp32 of a head's rotary frequencies for positions 0..N-1, grown on demand."""

    def __init__(self, inv_freq: Tensor) -> None:
        self._inv_freq = inv_freq
        self._table: tuple[Tensor, Tensor] | None = None

    def __call__(self, n: int) -> tuple[Tensor, Tensor]:
        if self._table is None or self._table[0].shape[0] < n:
            cos, sin = rope_cos_sin(self._inv_freq, torch.arange(n)[None], torch.float32)
            self._table = (cos[0, 0].contiguous(), sin[0, 0].contiguous())
        return self._table


class _EntryArgs(NamedTuple):
    """A head step's call as the decode step takes it."""

    pos: Tensor
    rows: Tensor
    last: Tensor
    kv_len: int
    cache_rope: tuple[Tensor, Tensor, Tensor, Tensor]  # the cache's k, v and the rotary cos, sin
    slots: Tensor
    mask: Tensor


class _EntriesKernel:
    """A head's layers over its own KV cache on the decode step (``AttnStepKernel``): the call's rows, rotary tables
    and tree in the step's form; ``_forward`` runs it."""

    def __init__(self, inv_freq: Tensor) -> None:
        self._rope = RopeTable(inv_freq)
        self._all_rows = torch.empty(0, dtype=torch.long)  # rows 0..B-1; no tree's slots
        self._no_mask = torch.empty(0, dtype=torch.bool)

    def __call__(
        self,
        f: Tensor,
        e: Tensor,
        pos: Tensor,
        rows: Tensor | None,
        cache: Any,
        kv_len: int,
        last: Tensor,
        tree: TreeMask | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Entries (features f, next tokens' embeddings e [B, T, H]) at positions pos [B, T] in cache rows ``rows``
        (None: 0..B-1) -> (scores [B, V'], the next features [B, H]) of each row's entry ``last`` [B] ([B, J]:
        [B, J, ..]); ``tree``: a draft tree's entries in its slots under its mask."""
        # a tree's slots [B, T] and mask [B, T, kv_len] as the step takes them (empty: entries by position)
        slots, mask = (self._all_rows, self._no_mask) if tree is None else (tree.slots, tree.mask[:, 0])
        rws = self._all_rows if rows is None else rows
        args = _EntryArgs(pos, rws, last, kv_len, (cache.k, cache.v, *self._rope(cache.max_seq_len)), slots, mask)
        return self._forward(f, e, args)

    def _forward(self, f: Tensor, e: Tensor, args: _EntryArgs) -> tuple[Tensor, Tensor]:
        raise NotImplementedError


class AttnHeadKernel(_EntriesKernel):
    """The EAGLE head with attention's decoder layers, output norm and scores in one C++ call: the decode step's
    kernel (engine/kernels/csrc/decode_model.cpp ``forward_x``) on the entries (``EagleAttnHead.entries`` of the
    drafter's features and embeddings, on PyTorch), with the head's own static KV cache. The layers' GEMM weights
    are copies in ``store`` (``layer_weights``: q/k/v and gate/up fused first, ``fuse_projections``); the LM head's
    rows stay the target's fp32 weight."""

    def __init__(self, head: AttnHeadLayers, lm_weight: Tensor, store: torch.dtype) -> None:
        sw = layer_weights(head.layers, store)  # (q/k/v and gate/up fused by the caller: fuse_projections)
        mcfg = head.mcfg
        H = mcfg.hidden_size
        sw.add(torch.zeros(1, H), head.out_norm.weight.detach(), lm_weight.detach().contiguous())  # (no embedding read)
        self.impl = cpu_kernels().DecodeModel(
            *sw.args(), mcfg.num_attention_heads, mcfg.num_key_value_heads, 0,
            mcfg.rms_norm_eps, False, False,
        )  # fmt: skip
        self.n_layers = mcfg.num_hidden_layers
        self._entries = head.entries
        super().__init__(head.inv_freq)

    def _forward(self, f: Tensor, e: Tensor, args: _EntryArgs) -> tuple[Tensor, Tensor]:
        hidden = torch.empty(1)
        x = self._entries(f, e).float().contiguous()
        logits = self.impl.forward_x(x, args.pos, args.rows, args.last, args.kv_len, self.n_layers, *args.cache_rope,
                                     hidden, args.slots, args.mask)  # fmt: skip
        return logits, hidden


class Eagle3HeadKernel(_EntriesKernel):
    """EAGLE-3's layer, norm and scores in one C++ call (the decode step's ``forward_pair``): the layer's q/k/v read
    [input_layernorm(e); hidden_norm(f)] (2H, computed here on PyTorch), f the residual; returns each row's
    scores and the layer's output g before the norm (the next entry's feature). GEMM weights, the LM head's
    included (the head's own), are copies in ``store``."""

    def __init__(self, head: Eagle3Layers, weights: list[Tensor], store: torch.dtype) -> None:
        """``weights``: ``head.kernel_weights``'s, every one readable."""
        q, k, v, o, gate, up, down, lm = (w.detach().to(store) for w in weights)
        mcfg = head.mcfg
        none = torch.empty(0)
        post = head.midlayer.post_attention_layernorm.weight.detach().float().contiguous()
        ws = [torch.ones(mcfg.hidden_size), torch.cat([q, k, v]).contiguous(), none, o.contiguous(), none, post]
        ws += [torch.cat([gate, up]).contiguous(), down.contiguous(), none]
        ws += [torch.zeros(1, mcfg.hidden_size), head.norm.weight.detach().float().contiguous(), lm.contiguous()]
        n = len(ws)
        self.impl = cpu_kernels().DecodeModel(
            ws, [none] * n, [none] * n, [0] * n, mcfg.num_attention_heads, mcfg.num_key_value_heads, 0,
            mcfg.rms_norm_eps, False, False,
        )  # fmt: skip
        self._inputs = head.midlayer.inputs
        self._out = torch.tensor([1], dtype=torch.long)  # "entering layer 1": the layer's output, before the norm
        super().__init__(head.inv_freq)

    def _forward(self, f: Tensor, e: Tensor, args: _EntryArgs) -> tuple[Tensor, Tensor]:
        x, res = self._inputs(f, e)
        g = torch.empty(1)
        x, res = x.float().contiguous(), res.float().contiguous()
        logits = self.impl.forward_pair(x, res, args.pos, args.rows, args.last, args.kv_len, *args.cache_rope, g,
                                        self._out, args.slots, args.mask)  # fmt: skip
        return logits, g
