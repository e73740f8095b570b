"""Quantized modules: they hold the data, a named kernel (quant.matmul_kernels) computes.

    FP8Linear     e4m3 weight [out, in] + float32 scale per output channel; kernels native | te | weight-only
    FP8Embedding  e4m3 table [vocab, hidden] + float32 scale per row, dequantized on lookup
    Int8Linear    int8 weight [out, in] + float32 scale per output channel [out] (+ optional SmoothQuant
                  factors [in]; kernels w8a8 | llm-int8 | w8a16), or per group of ``group_size`` input
                  channels [out, ceil(in / group_size)] (kernel w8a16 only)

Every module: ``from_float(module, kernel=..., **scaling)``, ``forward(x)`` for x
[..., in] in the compute dtype (returns that dtype), ``set_kernel(name)`` to run
another kernel on the same data, ``weight_bytes()`` (bytes stored: quantized data,
scales, smoothing factors, bias).

The quantized data and its float32 scales are parameters without gradient, so a
tied table stays one tensor under ``.to(device)``, and they keep their dtype under
``model.half()`` / ``model.to(dtype)``: only the bias and the compute dtype follow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.errors import InvalidConfigError

from .fp8 import FP8_DTYPE, quantize_fp8_rowwise
from .int8 import quantize_int8_groupwise, quantize_int8_rowwise
from .matmul_kernels import ACTIVATION_INT8_KERNELS, LLM_INT8_THRESHOLD, Kernel, get_kernel, require_kernel
from .smooth import DEFAULT_ALPHA, smooth_scales

_KEEP_DTYPE = ("weight", "weight_scale", "smooth")


def _frozen(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _nbytes(*ts: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


class _DtypeKeeping(nn.Module):
    """Quantized data and scales keep their dtype under ``.to(dtype)``; the compute dtype follows."""

    def __init__(self, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.compute_dtype = compute_dtype

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> _DtypeKeeping:
        keep = {n: p.data for n, p in self._parameters.items() if n in _KEEP_DTYPE and p is not None}
        self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype)).dtype
        super()._apply(fn, recurse)
        for n, old in keep.items():
            p = self._parameters[n]
            if p is not None and p.dtype != old.dtype:  # a dtype cast: keep fp8/int8 data and fp32 scales
                p.data = old.to(p.device)
        return self


class _Quantized(_DtypeKeeping):
    """Shared plumbing of the Linears: kernel choice and its device check."""

    family = ""
    group_size: int | None = None  # Int8Linear: input channels per weight scale (None: one per output channel)

    def __init__(self, compute_dtype: torch.dtype) -> None:
        super().__init__(compute_dtype)
        self.kernel_state: dict[str, Any] = {}  # per-instance kernel caches (te keeps its module here)
        self._kernel: Kernel | None = None
        self._checked_device: torch.device | None = None

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> _Quantized:
        super()._apply(fn, recurse)
        self.kernel_state.clear()
        return self

    @property
    def kernel(self) -> str:
        assert self._kernel is not None
        return self._kernel.name

    def set_kernel(self, name: str) -> None:
        """Choose the kernel by name; it is checked against the data's device now and on each new device."""
        if self.group_size is not None and name in ACTIVATION_INT8_KERNELS:
            raise InvalidConfigError(
                f"kernel={name!r} is invalid for int8 weights scaled per group of "
                f"{self.group_size} input channels: allowed w8a16"
            )
        self._kernel = get_kernel(self.family, name)
        self.kernel_state.clear()
        self._checked_device = None
        self._check(self.weight.device)

    def _check(self, device: torch.device) -> None:
        if self._checked_device != device:
            require_kernel(self.family, self.kernel, device)
            self._checked_device = device

    def _run(self, x: Tensor) -> Tensor:
        if not x.is_floating_point():
            raise InvalidConfigError(f"{type(self).__name__}: input dtype {x.dtype} is not a floating dtype")
        self._check(x.device)
        lead, K = x.shape[:-1], x.shape[-1]
        if K != self.in_features:
            raise InvalidConfigError(f"{type(self).__name__}: input has {K} features, expected {self.in_features}")
        x2 = x.reshape(-1, K)
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        assert self._kernel is not None
        return self._kernel.impl(self, x2).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, kernel={self.kernel!r}"
        )


class FP8Linear(_Quantized):
    family = "fp8"

    def __init__(
        self,
        weight: Tensor,
        weight_scale: Tensor,
        bias: Tensor | None,
        kernel: str = "native",
        compute_dtype: torch.dtype = torch.float16,
    ) -> None:
        super().__init__(compute_dtype)
        if weight.dtype != FP8_DTYPE or weight_scale.dtype != torch.float32:
            raise InvalidConfigError("FP8Linear needs an e4m3 weight and float32 scales (use FP8Linear.from_float)")
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else _frozen(weight)
        self.weight_scale = weight_scale if isinstance(weight_scale, nn.Parameter) else _frozen(weight_scale)
        self.bias = None if bias is None else _frozen(bias.detach().to(compute_dtype))
        self.smooth = None
        self.set_kernel(kernel)

    @classmethod
    def from_float(cls, linear: nn.Linear, kernel: str = "native") -> FP8Linear:
        """Per-output-channel e4m3 weights; activations are scaled per token at run time (native, te)."""
        q, s = quantize_fp8_rowwise(linear.weight.detach())
        return cls(q, s, linear.bias, kernel=kernel, compute_dtype=linear.weight.dtype)

    @classmethod
    def tied_to(cls, embedding: FP8Embedding, kernel: str = "native") -> FP8Linear:
        """An LM head sharing the FP8 table (and its per-row scales) of a tied embedding."""
        return cls(embedding.weight, embedding.weight_scale, None, kernel=kernel, compute_dtype=embedding.compute_dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self._run(x)

    def weight_bytes(self) -> int:
        return _nbytes(self.weight, self.weight_scale, self.bias)


RowKernel = Callable[[Tensor, Tensor, Tensor, int], Tensor]
"""(x [M, K] fp32 contiguous, int8 weight [N, K], float32 scales, group size or 0 per channel) -> x @ w^T [M, N]."""


class Int8Linear(_Quantized):
    family = "int8"
    row_kernel: RowKernel | None = None
    row_kernel_rows = 0

    def __init__(
        self,
        weight: Tensor,
        weight_scale: Tensor,
        bias: Tensor | None,
        kernel: str = "w8a8",
        smooth: Tensor | None = None,
        outlier_threshold: float = LLM_INT8_THRESHOLD,
        compute_dtype: torch.dtype = torch.float16,
        group_size: int | None = None,
    ) -> None:
        super().__init__(compute_dtype)
        if weight.dtype != torch.int8 or weight_scale.dtype != torch.float32:
            raise InvalidConfigError("Int8Linear needs an int8 weight and float32 scales (use Int8Linear.from_float)")
        if not outlier_threshold > 0:
            raise InvalidConfigError(f"outlier_threshold={outlier_threshold!r} is invalid: allowed > 0")
        _check_group_size(group_size)
        self.out_features, self.in_features = weight.shape
        groups = None if group_size is None else -(-self.in_features // group_size)
        want = (self.out_features,) if groups is None else (self.out_features, groups)
        if tuple(weight_scale.shape) != want:
            raise InvalidConfigError(
                f"weight_scale has shape {tuple(weight_scale.shape)}; expected {want} (group_size={group_size})"
            )
        self.group_size = group_size
        self.weight = _frozen(weight)
        self.weight_scale = _frozen(weight_scale)
        self.smooth = None if smooth is None else _frozen(smooth.detach().float())
        self.bias = None if bias is None else _frozen(bias.detach().to(compute_dtype))
        self.outlier_threshold = float(outlier_threshold)
        self.set_kernel(kernel)

    @classmethod
    def from_float(
        cls,
        linear: nn.Linear,
        kernel: str = "w8a8",
        act_absmax: Tensor | None = None,
        alpha: float = DEFAULT_ALPHA,
        outlier_threshold: float = LLM_INT8_THRESHOLD,
        group_size: int | None = None,
    ) -> Int8Linear:
        """Symmetric int8 weights, per output channel (``group_size`` None) or per group of
        ``group_size`` input channels (kernel w8a16); w8a8 / llm-int8 quantize activations per token.

        With ``act_absmax`` (per-input-channel calibration absmax) the SmoothQuant
        factors ``s`` are folded into the weight before quantization and the module
        divides its input by ``s`` at run time.
        """
        _check_group_size(group_size)
        if group_size is not None and kernel in ACTIVATION_INT8_KERNELS:
            raise InvalidConfigError(
                f"group_size={group_size} is invalid with kernel={kernel!r}: per-group "
                "scales need kernel 'w8a16'; allowed None (per output channel)"
            )
        w = linear.weight.detach().float()
        s = None
        if act_absmax is not None:
            s = smooth_scales(act_absmax, w, alpha)
            w = w * s[None, :]
        q, ws = quantize_int8_rowwise(w) if group_size is None else quantize_int8_groupwise(w, group_size)
        return cls(
            q,
            ws,
            linear.bias,
            kernel=kernel,
            smooth=s,
            outlier_threshold=outlier_threshold,
            compute_dtype=linear.weight.dtype,
            group_size=group_size,
        )

    def forward(self, x: Tensor) -> Tensor:
        return self._run(x)

    def use_row_kernel(self, kernel: RowKernel | None, max_rows: int = 0) -> None:
        """The kernels layer's hook (engine/kernels/cpu_int8.py): kernel w8a16 on the CPU runs fp32 inputs of
        at most ``max_rows`` rows through ``kernel`` (reading the int8 weight); None removes it."""
        self.row_kernel, self.row_kernel_rows = kernel, max_rows if kernel is not None else 0

    def weight_bytes(self) -> int:
        return _nbytes(self.weight, self.weight_scale, self.smooth, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", smoothquant={self.smooth is not None}, group_size={self.group_size}"


def _check_group_size(group_size: Any) -> None:
    if group_size is not None and (not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1):
        raise InvalidConfigError(
            f"group_size={group_size!r} is invalid: allowed an int >= 1 or None (per output channel)"
        )


class FP8Embedding(_DtypeKeeping):
    """An embedding table stored in e4m3 with one float32 scale per row, dequantized on lookup."""

    def __init__(self, weight: Tensor, weight_scale: Tensor, compute_dtype: torch.dtype = torch.float16) -> None:
        super().__init__(compute_dtype)
        if weight.dtype != FP8_DTYPE or weight_scale.dtype != torch.float32:
            raise InvalidConfigError("FP8Embedding needs an e4m3 table and float32 scales (use from_float)")
        self.num_embeddings, self.embedding_dim = weight.shape
        self.weight = _frozen(weight)
        self.weight_scale = _frozen(weight_scale)

    @classmethod
    def from_float(cls, embedding: nn.Embedding) -> FP8Embedding:
        q, s = quantize_fp8_rowwise(embedding.weight.detach())
        return cls(q, s, compute_dtype=embedding.weight.dtype)

    def forward(self, ids: Tensor) -> Tensor:
        rows = F.embedding(ids, self.weight.view(torch.uint8)).view(FP8_DTYPE)  # byte gather: any device
        return (rows.float() * F.embedding(ids, self.weight_scale[:, None])).to(self.compute_dtype)

    def weight_bytes(self) -> int:
        return _nbytes(self.weight, self.weight_scale)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, storage=fp8_e4m3, compute={self.compute_dtype}"
