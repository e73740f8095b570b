"""Resident weight bytes of a model as allocated: its parameters and buffers, and every copy a kernel holds
beside them (the decode step's 16-bit copies, oneDNN-packed weights, a quantized Linear's kernel state).

Tensors that share storage (a tied LM head, the views ``fuse_projections`` and ``cpu_int8.fused_int8`` leave in
the Linears) count once: each storage by its allocated size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor

from engine.core.model import Transformer
from engine.kernels.cpu_decode import DecodeStep
from engine.kernels.cpu_linear import OneDNNLinear, PackedFused
from quant.linear import FP8Linear, Int8Linear


def _kernel_tensors(model: Transformer) -> Iterator[Tensor]:
    if isinstance(model.layer_step, DecodeStep):
        yield from model.layer_step.tensors
    for m in model.modules():
        if isinstance(m, OneDNNLinear):
            yield m.packed
        elif isinstance(m, (Int8Linear, FP8Linear)):
            yield from (t for t in m.kernel_state.values() if isinstance(t, Tensor))
    for layer in model.layers:
        for f in (layer.self_attn.qkv, layer.mlp.gate_up):
            if isinstance(f, PackedFused):
                yield f.packed


def _storage_bytes(tensors: Iterable[Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.is_mkldnn:  # an opaque packed tensor: no storage to share
            total += t.numel() * t.element_size()
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.nbytes():
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def resident_weight_bytes(model: Transformer) -> int:
    """Bytes allocated for ``model``'s weights: parameters, buffers and the kernels' copies, each storage once."""
    return _storage_bytes([*model.parameters(), *model.buffers(), *_kernel_tensors(model)])
