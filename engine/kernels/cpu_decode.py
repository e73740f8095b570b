"""A fp32 model's few-row forward as one C++ call (engine/kernels/csrc/decode_model.cpp, decode_layers.cpp).

Why: a small model's step on a CPU is mostly PyTorch dispatch, not arithmetic (the demo draft's step
is ~50 PyTorch ops around a few small GEMMs; docs/performance.md has the timings). ``DecodeStep``
runs the same forward (embedding; per layer RMSNorm, fused q/k/v, rotary, the static KV cache,
causal attention, o_proj, RMSNorm, fused gate/up, SiLU, down; final norm and LM head on the scored
rows) in one call. ``Transformer.run`` uses it when installed (``Transformer.use_kernels(step=...)``) for every
call with a fp32 cache and no autograd, prompts included: a decode step often carries a new
sequence's prompt beside the others' tokens, and one path for all of them keeps every row's result
independent of what else is in the batch (the PyTorch forward rounds a large batch differently). The
PyTorch forward is its fallback with the same inputs and outputs (tests run both and compare).
``DecodeStep.greedy`` drafts k greedy tokens in one call (no Python between the draft steps).

The GEMM weights: fp32 (the model's own tensors) on the small-GEMM kernel (AVX-512 or AVX2), or 16-bit
copies widened in registers, or a precision plan's INT8 weights (kernel w8a16) read as int8 by the int8 GEMM
(engine/kernels/cpu_int8.py: dequantized in registers, the modules' own tensors, no fp32 copy; on a CPU with
AMX-INT8 read by tiles, engine/kernels/csrc/int8_amx.cpp, the inputs split into exact int8 parts), or a draft
plan's FP8 weights and embedding table dequantized once into the step's weight dtype
(engine/kernels/cpu_fp8.py). A model whose weights are all bf16 values (a bf16 checkpoint loaded in fp32,
as the demo pair v3 is) loses nothing in bf16 storage (``exact_weight_dtype``), and on a CPU with AMX its
GEMMs run on tiles (engine/kernels/csrc/amx_gemm.cpp: fp32 inputs split exactly into
three bf16 parts, fp32 accumulation), where the rows of a verify pass come almost free.

Every row is computed the same way whatever the number of rows in the call (both GEMM kernels are
row-independent and each query's attention is its own loop), so a verify pass and the one-token
steps agree bit for bit.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from engine.core.errors import KernelUnavailableError
from engine.core.model import Features, ForwardCall, ForwardOut, FusedLinear, StoredLinear, Transformer
from engine.core.stored_linear import StoredEmbedding
from engine.kernels.cpu_fp8 import fp8_reason
from engine.kernels.cpu_gemm import (
    SmallGemmLinear,
    amx_status,
    cpu_kernels,
    small_gemm_status,
)
from engine.kernels.cpu_int8 import int8_gemm_reason, step_int8_reason, uses_int8_amx
from engine.kernels.step_weights import (
    PER_WEIGHT,
    WEIGHT_DTYPES,
    exact_dtype,
    gemm_weights,
    layer_weights,
    slots,
    step_weight_dtype,
    table_and_head,
    vec,
)
from quant.linear import FP8Embedding, FP8Linear, Int8Linear

log = logging.getLogger(__name__)


def exact_weight_dtype(model: Transformer) -> torch.dtype:
    """The narrowest of ``WEIGHT_DTYPES`` holding every GEMM weight of ``model`` (a model
    ``decode_step_reason`` accepts) exactly: bfloat16 or float16 when all their values are of
    that dtype, else float32. The small-GEMM kernel computes the very same fp32 numbers on such a
    copy; AMX tiles (bf16) compute the same products and add them in another order."""
    return exact_dtype(gemm_weights(model))


def _plain_weight(mod: Any) -> bool:
    """An unquantized CPU projection: nn.Linear, a StoredLinear, a fused group or their small-GEMM forms, its
    weight float32 or (a StoredLinear's) 16-bit, its bias float32."""
    if not (type(mod) in (nn.Linear, SmallGemmLinear, StoredLinear) or isinstance(mod, FusedLinear)):
        return False
    w = mod.weight
    return (
        w.dtype in WEIGHT_DTYPES
        and w.device.type == "cpu"
        and w.is_contiguous()
        and (mod.bias is None or mod.bias.dtype == torch.float32)
    )


def decode_step_reason(model: Transformer) -> str | None:
    """None when ``DecodeStep`` can run this model here, else why not."""
    if model.dtype != torch.float32 or model.norm.weight.device.type != "cpu":
        return (
            f"needs a float32 model on the CPU (this one is {str(model.dtype).replace('torch.', '')} on "
            f"{model.norm.weight.device.type})"
        )
    if model.attn_fn.name != "sdpa_attention":
        return f"the model's attention backend is {model.attn_fn.name!r}, not sdpa_attention"
    cfg = model.config
    if cfg.num_attention_heads % cfg.num_key_value_heads or cfg.head_dim % 2:
        return "needs heads divisible by kv heads and an even head_dim"
    for i, layer in enumerate(model.layers):
        for name, (mod, parts) in slots(layer).items():
            why = _slot_reason(mod, parts)
            if why is not None:
                return f"layer {i} {name} {why}"
        gate_up = layer.mlp.gate_up
        if any(p.bias is not None for p in (layer.mlp.gate_proj, layer.mlp.up_proj) if gate_up is None) or (
            gate_up is not None and gate_up.bias is not None
        ):
            return f"layer {i} gate_up has a bias"
    head = model.lm_head
    head_ok = _plain_weight(head) or (isinstance(head, FP8Linear) and fp8_reason(head) is None)
    if (
        type(model.embed_tokens) not in (nn.Embedding, StoredEmbedding, FP8Embedding)
        or not head_ok
        or head.bias is not None
    ):
        return f"the embedding or LM head is not a plain, 16-bit stored or FP8 one ({type(head).__name__})"
    return small_gemm_status()


def _slot_reason(mod: Any, parts: tuple[nn.Module, ...]) -> str | None:
    """None when the step can run this GEMM: a plain fp32 weight, INT8 Linears the int8 GEMM reads, or FP8 Linears
    it reads dequantized (engine/kernels/cpu_fp8.py)."""
    if isinstance(parts[0], FP8Linear):
        for p in parts:
            why = fp8_reason(p) if isinstance(p, FP8Linear) else f"mixes {type(p).__name__} with FP8"
            if why is not None:
                return why
        return None
    if isinstance(parts[0], Int8Linear):
        if len(parts) == 1:
            why = step_int8_reason(parts[0])
            return None if why is None else f"is INT8 the step cannot run: {why}"
        for p in parts:
            why = int8_gemm_reason(p) if isinstance(p, Int8Linear) else f"mixes {type(p).__name__} with INT8"
            if why is not None:
                return f"is INT8 the step cannot read: {why}"
        groups = {p.group_size for p in parts}  # type: ignore[union-attr]
        finest = min((g for g in groups if g is not None), default=None)
        if any(g is not None and finest is not None and g % finest for g in groups):
            return f"stacks INT8 groups {sorted(groups, key=str)} that do not divide one another"
        return None
    if mod is None and type(parts[0]) in (nn.Linear, StoredLinear):
        return "is not fused (fuse_projections first)"
    if mod is None or not _plain_weight(mod):
        return f"is {type(parts[0] if mod is None else mod).__name__}, not a plain fp32 projection"
    return None


class DecodeStep:
    """``model``'s forward with a cache as one C++ call (same inputs and result as PyTorch's)."""

    def __init__(
        self, model: Transformer, weight_dtype: torch.dtype | str = torch.float32, amx: bool | None = None
    ) -> None:
        """``amx``: the GEMMs on AMX tiles (bf16 weights only): None where this CPU has them, True requires them."""
        reason = decode_step_reason(model)
        if reason is not None:
            raise KernelUnavailableError(f"the fp32 decode-step kernel cannot run this model: {reason}")
        if weight_dtype not in (*WEIGHT_DTYPES, PER_WEIGHT):
            raise ValueError(
                f"weight_dtype={weight_dtype} is invalid: allowed {', '.join(str(d) for d in WEIGHT_DTYPES)}, "
                f"{PER_WEIGHT!r}"
            )
        if amx and weight_dtype != torch.bfloat16:
            raise ValueError(f"amx=True is invalid with weight_dtype={weight_dtype}: allowed torch.bfloat16")
        amx_reason = amx_status()
        if amx and amx_reason:
            raise KernelUnavailableError(f"AMX tiles are unavailable: {amx_reason}")
        self.amx = bool(weight_dtype == torch.bfloat16 and amx is not False and not amx_reason)
        self.int8_amx = uses_int8_amx(model)  # its INT8 Linears' kernel, as their row kernel outside the step
        self.model, self.weight_dtype = model, weight_dtype

        sw = layer_weights(model.layers, weight_dtype)
        table, head = table_and_head(model, weight_dtype)
        sw.add(table, vec(model.norm.weight), head)
        cfg = model.config
        self.n_layers = cfg.num_hidden_layers
        self.tensors = sw.tensors()  # what the step holds (Engine.stats counts its copies as resident weights)
        if weight_dtype == PER_WEIGHT:  # what it chose: one dtype, or each weight its own
            used = {t.dtype for t in sw.weights if t.dim() == 2 and t.is_floating_point()}
            self.weight_dtype = used.pop() if len(used) == 1 else "+".join(sorted(str(d)[6:] for d in used))
        # the C++ side holds the weights (and checks their shapes once): a call passes only the step's tensors
        self.impl = cpu_kernels().DecodeModel(
            *sw.args(),
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.sliding_window or 0,
            cfg.rms_norm_eps,
            self.amx,
            self.int8_amx,
        )
        self._empty = torch.empty(0, dtype=torch.long)
        self._empty_f = torch.empty(0)
        self._empty_b = torch.empty(0, dtype=torch.bool)
        self._layers: dict[tuple[int, ...], Tensor] = {(): self._empty}

    def takes(self, call: ForwardCall) -> bool:
        """Whether this call goes through the kernel: a fp32 cache and no autograd (a draft tree's verify too:
        the kernel writes its slots and applies its mask)."""
        cache = call.cache
        return (
            cache is not None
            and cache.k.dtype == torch.float32
            and not (torch.is_grad_enabled() and self.model.norm.weight.requires_grad)
        )

    def run(self, call: ForwardCall, feature_layers: tuple[int, ...] = ()) -> ForwardOut:
        """The forward of ``call`` (``Transformer.run``'s result): logits [B,T,V] ([B,V] / [B,J,V] at logits_idx
        [B] / [B,J]) and, with ``call.features``, the final-norm outputs of the scored rows (every row: ALL), or
        with ``feature_layers`` the hidden states entering those layers, concatenated [..., n * H]."""
        want = call.features is not Features.NONE
        aux = self._aux(feature_layers)  # (the model passes none without features)
        cache = call.cache
        assert cache is not None and call.kv_len is not None
        cos, sin = self.model.rope_table(cache.max_seq_len, torch.float32)
        h = torch.empty(1) if want else self._empty_f
        tree, idx = call.tree, call.logits_idx
        logits = self.impl.forward(
            call.tokens,
            self._pos(call),
            self._empty if call.rows is None else call.rows,
            self._empty if idx is None else idx,
            call.kv_len,
            self.n_layers if call.n_layers is None else call.n_layers,
            cache.k,
            cache.v,
            cos,
            sin,
            h,
            self._empty if tree is None else tree.slots,
            self._empty_b if tree is None else tree.mask[:, 0],
            aux,
            call.features is Features.ALL,
        )
        return ForwardOut(logits, h if want else None)

    def _aux(self, layers: tuple[int, ...]) -> Tensor:
        """The feature layers as the kernel takes them ([n] int64; empty: the final-norm outputs), made once."""
        t = self._layers.get(layers)
        if t is None:
            t = self._layers[layers] = torch.tensor(layers, dtype=torch.long)
        return t

    @staticmethod
    def _pos(call: ForwardCall) -> Tensor:
        if call.pos is not None:
            return call.pos
        B, T = call.tokens.shape
        return torch.arange(T).expand(B, T)

    def greedy(self, call: ForwardCall, last: Tensor, steps: int, vocab: int) -> Tensor:
        """Greedy drafting in one call: ``call`` scored at ``last`` [B], then ``steps`` - 1 one-token
        forwards, each on the previous argmax over the first ``vocab`` logits -> the argmaxes [B, steps]
        (what ``run`` and ``argmax`` in a loop return, without the Python between steps)."""
        cache = call.cache
        assert cache is not None and call.kv_len is not None
        cos, sin = self.model.rope_table(cache.max_seq_len, torch.float32)
        return self.impl.greedy(
            call.tokens,
            self._pos(call),
            self._empty if call.rows is None else call.rows,
            last,
            call.kv_len,
            self.n_layers if call.n_layers is None else call.n_layers,
            cache.k,
            cache.v,
            cos,
            sin,
            steps,
            vocab,
        )


def install_decode_step(model: Transformer, weight_dtype: torch.dtype | str | None = None) -> str | None:
    """Run ``model``'s cached forwards through ``DecodeStep``; None when installed, else why not (logged).
    ``weight_dtype`` None: ``exact_weight_dtype(model)`` (lossless); "auto": that when it is 16-bit, else
    float16 (for a draft: rounding its weights moves only the acceptance)."""
    reason = decode_step_reason(model)
    if reason is not None:
        log.info("the model's steps stay on PyTorch: %s", reason)
        model.use_kernels(step=None)
        return reason
    model.use_kernels(step=DecodeStep(model, step_weight_dtype(gemm_weights(model), weight_dtype)))
    return None


def step_info(models: dict[str, Transformer | None]) -> dict[str, Any]:
    """For the engine's info, per named model: ``<name>_step_weights`` (the step's GEMM weight storage),
    ``<name>_step_amx`` (16-bit GEMMs on AMX tiles) and ``<name>_step_int8_amx`` (INT8 ones on AMX-INT8 tiles),
    all None where the model has no step."""
    info: dict[str, Any] = {}
    for name, m in models.items():
        step = None if m is None else m.layer_step
        info[f"{name}_step_weights"] = None if step is None else str(step.weight_dtype).replace("torch.", "")
        info[f"{name}_step_amx"] = None if step is None else step.amx
        info[f"{name}_step_int8_amx"] = None if step is None else step.int8_amx
    return info
