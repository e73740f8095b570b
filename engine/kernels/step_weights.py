"""The C++ decode step's weights (engine/kernels/cpu_decode.py ``DecodeStep``): which float storage each GEMM
weight takes, and the tensors in the order the C++ ``DecodeModel`` reads them (9 per layer, then the embedding
table, the final norm and the LM head). INT8 Linears are stacked as they are (engine/kernels/cpu_int8.py); FP8
ones are dequantized once (engine/kernels/cpu_fp8.py); plain ones are shared in fp32 or copied in 16 bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from engine.core.checkpoint import DTYPES
from engine.core.model import Transformer
from engine.kernels.cpu_fp8 import fp8_table, fp8_weight
from engine.kernels.cpu_gemm import amx_status
from engine.kernels.cpu_int8 import Int8Weight, fused_int8
from quant.linear import FP8Embedding, FP8Linear, Int8Linear

# the GEMM weights' storage in the kernel: float32 (the model's own tensors, shared) or 16-bit copies
# (widened to fp32 in registers: half the bytes a step streams). A copy is lossless when every weight
# already has a value of that dtype (a bf16 or fp16 checkpoint loaded in fp32: cpu_decode.exact_weight_dtype);
# otherwise it rounds, which only a draft may do (the target verifies its proposals: the output is
# unchanged and only the acceptance can move)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PER_WEIGHT = "exact"  # each GEMM weight in its own narrowest lossless dtype (a plan's fp16-valued attention
# beside a bf16-valued LM head: neither dtype holds both, each holds its own)


def slots(layer: Any) -> dict[str, tuple[Any, tuple[nn.Module, ...]]]:
    """A decoder layer's 4 GEMMs: name -> (the float module running it or None, the Linears it stands for)."""
    a, m = layer.self_attn, layer.mlp
    return {
        "qkv": (a.qkv, (a.q_proj, a.k_proj, a.v_proj)),
        "o_proj": (a.o_proj, (a.o_proj,)),
        "gate_up": (m.gate_up, (m.gate_proj, m.up_proj)),
        "down_proj": (m.down_proj, (m.down_proj,)),
    }


def _float_parts(parts: tuple[nn.Module, ...]) -> list[Tensor]:
    """A slot's float GEMM weights part by part (a fused group's parts are views of its weight; FP8 ones
    dequantized, float32); none for INT8 Linears (read as they are)."""
    if isinstance(parts[0], Int8Linear):
        return []
    return [fp8_weight((p,)) if isinstance(p, FP8Linear) else p.weight for p in parts]


def _slot_weights(model: Transformer, names: tuple[str, ...]) -> list[Tensor]:
    """The float GEMM weights of the named slots in every layer, fused or not."""
    return [w for layer in model.layers for n, (_, ps) in slots(layer).items() if n in names for w in _float_parts(ps)]


def _head_weight(model: Transformer) -> Tensor:
    head = model.lm_head
    return fp8_weight((head,)) if isinstance(head, FP8Linear) else head.weight


def gemm_weights(model: Transformer) -> list[Tensor]:
    """The float GEMM weights of the step, part by part (INT8 ones are read as they are)."""
    return _slot_weights(model, ("qkv", "o_proj", "gate_up", "down_proj")) + [_head_weight(model)]


def step_weight_dtype(weights: list[Tensor], choice: torch.dtype | str | None) -> torch.dtype | str:
    """How a C++ step stores these GEMM weights: None -> ``exact_dtype(weights)`` (lossless) when it is 16-bit,
    else PER_WEIGHT (each weight's own lossless dtype); "auto" -> the common exact dtype when it is 16-bit, else
    float16 (a draft's rounding: only the acceptance can move); a dtype or its name (as
    ``KernelOptions.draft_step_weights`` gives it) -> that dtype (the step checks it)."""
    if choice is None or choice == "auto":
        exact = exact_dtype(weights)
        if exact != torch.float32:
            return exact
        return torch.float16 if choice == "auto" else PER_WEIGHT
    return DTYPES.get(choice, choice) if isinstance(choice, str) else choice


def dense_step_storage(model: Transformer) -> str:
    """How the step would hold a dense FFN Linear of ``model`` (the planner's baseline, ``CpuCostMeter.dense``): the
    storage ``step_weight_dtype`` gives the model's float GEMM weights (16-bit stored and FP8 ones included, fused
    or not), on AMX tiles where that is bf16 and this CPU has them; where each weight keeps its own, the FFN's
    float weights' common lossless dtype."""
    step = step_weight_dtype(gemm_weights(model), None)
    if step == PER_WEIGHT:
        ffn = _slot_weights(model, ("gate_up", "down_proj"))
        step = exact_dtype(ffn) if ffn else torch.float32
    elif step == torch.bfloat16 and amx_status() is None:
        return "bf16-amx"
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[step]


def exact_dtype(weights: list[Tensor]) -> torch.dtype:
    """bfloat16 or float16 when every value of ``weights`` is of that dtype, else float32."""
    for dtype in (torch.bfloat16, torch.float16):
        if all(torch.equal(w.detach().to(dtype).float(), w.detach()) for w in weights):
            return dtype
    return torch.float32


def mat(t: Tensor, dtype: torch.dtype | str) -> Tensor:  # a GEMM weight: shared in fp32, a 16-bit copy otherwise
    return t.detach().to(exact_dtype([t]) if dtype == PER_WEIGHT else dtype).contiguous()


def vec(t: Tensor | None) -> Tensor:  # a norm weight or bias (none: empty)
    return torch.empty(0) if t is None else t.detach()


def table_and_head(model: Transformer, dtype: torch.dtype | str) -> tuple[Tensor, Tensor]:
    """The embedding table (a plain one as it is; an FP8 one dequantized in the GEMM weights' dtype) and the LM
    head's weight; a tied FP8 pair shares one copy."""
    emb, head = model.embed_tokens, model.lm_head
    if not isinstance(emb, FP8Embedding):
        return vec(emb.weight), mat(_head_weight(model), dtype)
    table = mat(fp8_table(emb), dtype)
    tied = isinstance(head, FP8Linear) and head.weight is emb.weight and head.weight_scale is emb.weight_scale
    return table, table if tied else mat(_head_weight(model), dtype)


@dataclass
class StepWeights:
    """The C++ ``DecodeModel``'s tensors: per tensor an int8 GEMM weight's scales and group size (empty, 0 else)."""

    weights: list[Tensor] = field(default_factory=list)
    scales: list[Tensor] = field(default_factory=list)
    smooths: list[Tensor] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)

    def add(self, *ts: Tensor) -> None:
        for t in ts:
            self.add_int8(Int8Weight(t, torch.empty(0), 0, torch.empty(0)))

    def add_int8(self, w: Int8Weight) -> None:
        self.weights.append(w.q)
        self.scales.append(w.scale)
        self.smooths.append(w.smooth)
        self.groups.append(w.group)

    def args(self) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[int]]:
        """The C++ ``DecodeModel``'s first four arguments."""
        return self.weights, self.scales, self.smooths, self.groups

    def tensors(self) -> list[Tensor]:
        return [t for t in self.weights + self.scales + self.smooths if t.numel()]


def _gemm(sw: StepWeights, mod: Any, parts: tuple[nn.Module, ...], dtype: torch.dtype | str, bias: bool) -> None:
    """One GEMM slot (and its bias when ``bias``): INT8 Linears stacked as they are, else the float weight."""
    q = fused_int8(parts) if isinstance(parts[0], Int8Linear) else None
    if q is not None:
        sw.add_int8(q)
        b = _stacked_bias(parts)
    elif isinstance(parts[0], FP8Linear):
        sw.add(mat(fp8_weight(parts), dtype))
        b = _stacked_bias(parts)
    else:
        sw.add(mat(mod.weight, dtype))
        b = mod.bias
    if bias:
        sw.add(vec(b))


def _stacked_bias(parts: tuple[nn.Module, ...]) -> Tensor | None:
    """Quantized Linears' biases stacked as their slot fuses them (float32; zeros for one without), or None."""
    bs = [p.bias for p in parts]
    if all(b is None for b in bs):
        return None
    return torch.cat([torch.zeros(p.out_features) if b is None else b.detach().float() for p, b in zip(parts, bs)])  # type: ignore[union-attr]


def layer_weights(layers: Any, weight_dtype: torch.dtype | str) -> StepWeights:
    """The decoder layers' tensors in the C++ ``DecodeModel``'s order, 9 per layer: input norm, q/k/v weight and
    bias, o_proj weight and bias, post norm, gate/up weight, down weight and bias (q/k/v and gate/up fused:
    ``fuse_projections``, or INT8 Linears stacked by ``fused_int8``; float GEMM weights in ``weight_dtype``,
    INT8 ones as they are, the rest as they are, a missing bias empty)."""
    sw = StepWeights()
    for layer in layers:
        g = slots(layer)
        sw.add(vec(layer.input_layernorm.weight))
        _gemm(sw, *g["qkv"], weight_dtype, True)
        _gemm(sw, *g["o_proj"], weight_dtype, True)
        sw.add(vec(layer.post_attention_layernorm.weight))
        _gemm(sw, *g["gate_up"], weight_dtype, False)
        _gemm(sw, *g["down_proj"], weight_dtype, True)
    return sw
