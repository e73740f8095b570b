"""The ONNX graph of one Llama-family decode/verify step, built node by node with onnx.helper.

    model = build_step_graph(transformer)     # an onnx.ModelProto (opset 21)

Inputs and outputs (``L`` layers; symbolic axes in quotes):

    input_ids            int64 ["batch", "step"]
    positions            int64 ["batch", "step"]        cache slot = position of every token
    past_key_values.{i}.key / .value   float32 ["batch", Hkv, "past_seq", D]
    -> logits            float32 ["batch", "step", V]
    -> present.{i}.key / .value        float32 ["batch", Hkv, "total_seq", D]   (past ++ new, along axis 2)

The key at slot ``j`` is visible to the query at position ``p`` iff ``j <= p`` (and
``p - j < sliding_window`` when the model has one): specmix's position mask. The rows of
a batch share the past length; a prefill passes past_seq = 0, a speculative verify
passes step = K + 1 and a rollback is the caller slicing present to the accepted length.

Modules map one to one (the graph always computes in float32, like specmix's CPU plans):

    nn.Linear, OneDNNLinear,
    SmallGemmLinear, StoredLinear  Gemm(x, W, transB=1) with W the float32 weight [out, in] (a StoredLinear's
                                 16-bit values widened)
    Int8Linear (kernel w8a8)     [Div by the SmoothQuant factors] -> per-token dynamic
                                 QuantizeLinear(int8, axis 0) -> DequantizeLinear, times
                                 DequantizeLinear(int8 W, per-channel scale, axis 0) in a Gemm
    Int8Linear (kernel w8a16)    [Div by the SmoothQuant factors], times DequantizeLinear(int8 W, per-channel
                                 scale, axis 0; or per group, axis 1 with block_size) in a Gemm
    FP8Linear (weight-only)      DequantizeLinear(FLOAT8E4M3FN W, per-channel scale, axis 0) -> Gemm
    FP8Linear (native)           as weight-only plus per-token dynamic e4m3 Q/DQ of the activation
    FP8Embedding                 DequantizeLinear(table, per-row scale, axis 0) -> Gather (ONNX's
                                 Gather has no float8 type, so the table is dequantized first);
                                 a tied FP8 LM head reuses the same dequantized table

The per-token scale is specmix's (quant/fp8.py rowwise_scale): absmax / qmax, stepped one ulp
down while ``qmax * scale > absmax`` (``scale * (1 - 2^-24)`` is exactly that step for a normal
float32), at least the smallest normal float32.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from engine.core.errors import InvalidConfigError
from engine.core.model import StoredLinear, Transformer
from engine.core.stored_linear import StoredEmbedding

OPSET = 21
IR_VERSION = 10  # onnx 1.16 / onnxruntime 1.18 and later read it
_FLOAT8_STEP_DOWN = 1.0 - 2.0**-24
_TINY = float(np.finfo(np.float32).tiny)
EXPORTABLE_KERNELS = {"int8": ("w8a8", "w8a16"), "fp8": ("weight-only", "native")}


class _Graph:
    """Nodes, initializers and fresh names; initializers are deduplicated by tensor identity."""

    def __init__(self) -> None:
        from onnx import TensorProto, helper, numpy_helper

        self.h, self.TP, self.nph = helper, TensorProto, numpy_helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._names: dict[str, int] = {}
        self._by_tensor: dict[tuple[int, int, str, tuple[int, ...]], str] = {}
        self._memo: dict[tuple[Any, ...], str] = {}

    def fresh(self, base: str) -> str:
        n = self._names.get(base, 0)
        self._names[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def op(self, op_type: str, inputs: list[str], name: str | None = None, n_out: int = 1, **attrs: Any) -> Any:
        outs = [self.fresh(f"{name or op_type.lower()}" + (f"_o{i}" if n_out > 1 else "")) for i in range(n_out)]
        self.nodes.append(self.h.make_node(op_type, inputs, outs, name=self.fresh(f"n_{outs[0]}"), **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value: Any, dtype: Any = np.float32, name: str = "c") -> str:
        arr = np.asarray(value, dtype=dtype)
        key = ("const", arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._memo:
            nm = self.fresh(name)
            self.inits.append(self.nph.from_array(arr, nm))
            self._memo[key] = nm
        return self._memo[key]

    def tensor(self, t: Tensor, name: str) -> str:
        """An initializer holding ``t`` (float -> float32, int8, e4m3 kept bit for bit); shared tensors once."""
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), str(t.dtype), tuple(t.shape))
        if key in self._by_tensor:
            return self._by_tensor[key]
        nm = self.fresh(name)
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.float8_e4m3fn:
            raw = t.view(torch.uint8).numpy().tobytes()
            self.inits.append(self.h.make_tensor(nm, self.TP.FLOAT8E4M3FN, list(t.shape), raw, raw=True))
        elif t.dtype == torch.int8:
            self.inits.append(self.nph.from_array(t.numpy(), nm))
        elif t.is_floating_point():
            self.inits.append(self.nph.from_array(t.float().numpy(), nm))
        else:
            raise InvalidConfigError(f"{name}: tensor dtype {t.dtype} cannot be exported: allowed float, int8, e4m3")
        self._by_tensor[key] = nm
        return nm

    def memo(self, key: tuple[Any, ...], make: Any) -> str:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]


class _StepBuilder:
    """Emits the step graph of one Transformer (see the module docstring)."""

    def __init__(self, model: Transformer | None) -> None:  # None: single modules (build_linear_graph)
        self.m, self.cfg, self.g = model, None if model is None else model.config, _Graph()
        self.quant: dict[str, set[str]] = {}

    # ------------------------------------------------------------------ quantization pieces
    def _note(self, what: str, name: str) -> None:
        """Record ``name`` under ``what``, its layer index as ``*`` (layers.*.mlp.up_proj)."""
        parts = name.split(".")
        if len(parts) > 1 and parts[0] == "layers":
            parts[1] = "*"
        self.quant.setdefault(what, set()).add(".".join(parts))

    def _dynamic_qdq(self, x: str, qmax: float, elem: int, name: str) -> str:
        """Per-token (per-row of x [M, K]) symmetric dynamic quantization -> the dequantized x."""
        g = self.g
        amax = g.op("ReduceMax", [g.op("Abs", [x], f"{name}_abs"), g.const([1], np.int64)], f"{name}_amax", keepdims=0)
        qm = g.const(qmax)
        scale = g.op("Div", [amax, qm], f"{name}_scale0")
        for i in range(2):  # quant/fp8.py rowwise_scale: never qmax * scale > amax
            over = g.op("Greater", [g.op("Mul", [scale, qm], f"{name}_chk{i}"), amax], f"{name}_over{i}")
            down = g.op("Mul", [scale, g.const(_FLOAT8_STEP_DOWN)], f"{name}_down{i}")
            scale = g.op("Where", [over, down, scale], f"{name}_scale{i + 1}")
        scale = g.op("Max", [scale, g.const(_TINY)], f"{name}_xscale")
        sat = {"saturate": 1} if elem == g.TP.FLOAT8E4M3FN else {}
        q = g.op("QuantizeLinear", [x, scale], f"{name}_xq", axis=0, output_dtype=elem, **sat)
        return g.op("DequantizeLinear", [q, scale], f"{name}_xdq", axis=0)

    def _dequant_weight(self, weight: Tensor, scale: Tensor, name: str, group: int | None = None) -> str:
        """DequantizeLinear of a [out, in] weight: a scale per row (axis 0), or per row and group of ``group``
        inputs (opset 21's blocked quantization along axis 1)."""
        g = self.g
        w, s = g.tensor(weight, f"{name}.weight"), g.tensor(scale, f"{name}.weight_scale")
        attrs: dict[str, int] = {"axis": 0} if group is None else {"axis": 1, "block_size": group}
        return g.memo(("dq", w, s), lambda: g.op("DequantizeLinear", [w, s], f"{name}.weight_dq", **attrs))

    def linear(self, x: str, mod: nn.Module, name: str) -> str:
        """x [M, in] -> [M, out] for an nn.Linear or one of quant.linear's modules."""
        from engine.kernels.cpu_gemm import SmallGemmLinear
        from engine.kernels.cpu_linear import OneDNNLinear
        from quant.linear import FP8Linear, Int8Linear

        g = self.g
        if isinstance(mod, Int8Linear):
            if mod.kernel not in EXPORTABLE_KERNELS["int8"]:
                raise InvalidConfigError(
                    f"{name}: int8 kernel={mod.kernel!r} cannot be exported to ONNX: allowed "
                    f"{', '.join(EXPORTABLE_KERNELS['int8'])} (LLM.int8's outlier split has no "
                    "Q/DQ form); plan the FFN with int8_kernel='w8a8' or 'w8a16'"
                )
            if mod.smooth is not None:
                x = g.op("Div", [x, g.tensor(mod.smooth, f"{name}.smooth")], f"{name}_smoothed")
                self._note("int8 SmoothQuant", name)
            if mod.kernel == "w8a8":  # the activations quantized per token; w8a16 keeps them in float
                x = self._dynamic_qdq(x, 127.0, g.TP.INT8, name)
            w = self._dequant_weight(mod.weight, mod.weight_scale, name, mod.group_size)
            self._note(f"int8 {mod.kernel}", name)
        elif isinstance(mod, FP8Linear):
            if mod.kernel not in EXPORTABLE_KERNELS["fp8"]:
                raise InvalidConfigError(
                    f"{name}: fp8 kernel={mod.kernel!r} cannot be exported to ONNX: allowed "
                    f"{', '.join(EXPORTABLE_KERNELS['fp8'])} (transformer-engine's delayed "
                    "scaling keeps run-time state)"
                )
            if mod.kernel == "native":
                x = self._dynamic_qdq(x, 448.0, g.TP.FLOAT8E4M3FN, name)
            w = self._dequant_weight(mod.weight, mod.weight_scale, name)
            self._note(f"fp8 {mod.kernel}", name)
        elif type(mod) in (nn.Linear, OneDNNLinear, SmallGemmLinear, StoredLinear):  # float32 (a 16-bit one widened)
            w = g.tensor(mod.weight, f"{name}.weight")
        else:
            raise InvalidConfigError(
                f"{name}: module {type(mod).__name__} cannot be exported: allowed nn.Linear, "
                "StoredLinear, OneDNNLinear, SmallGemmLinear, Int8Linear, FP8Linear"
            )
        ins = [x, w] + ([g.tensor(mod.bias, f"{name}.bias")] if mod.bias is not None else [])
        return g.op("Gemm", ins, f"{name}_out", transB=1)

    def embed(self, ids_flat: str) -> str:
        from quant.linear import FP8Embedding

        mod, g = self.m.embed_tokens, self.g
        if isinstance(mod, FP8Embedding):
            table = self._dequant_weight(mod.weight, mod.weight_scale, "embed_tokens")
            self._note("fp8 embedding", "embed_tokens")
        elif type(mod) in (nn.Embedding, StoredEmbedding):  # float32 (a 16-bit table widened)
            table = g.tensor(mod.weight, "embed_tokens.weight")
        else:
            raise InvalidConfigError(
                f"embed_tokens: module {type(mod).__name__} cannot be exported: allowed nn.Embedding, "
                "StoredEmbedding, FP8Embedding"
            )
        return g.op("Gather", [table, ids_flat], "embeds", axis=0)

    # ------------------------------------------------------------------ the decoder
    def rms_norm(self, x: str, mod: nn.Module, name: str) -> str:
        g = self.g
        ms = g.op("ReduceMean", [g.op("Mul", [x, x], f"{name}_sq"), g.const([-1], np.int64)], f"{name}_ms", keepdims=1)
        inv = g.op(
            "Reciprocal",
            [g.op("Sqrt", [g.op("Add", [ms, g.const(mod.eps)], f"{name}_mse")], f"{name}_rms")],
            f"{name}_inv",
        )
        return g.op("Mul", [g.tensor(mod.weight, f"{name}.weight"), g.op("Mul", [x, inv], f"{name}_n")], f"{name}_out")

    def rope(self, x: str, cos: str, sin: str, name: str) -> str:
        g, half = self.g, self.cfg.head_dim // 2
        x1, x2 = g.op("Split", [x, g.const([half, half], np.int64)], f"{name}_half", n_out=2, axis=-1)
        rot = g.op("Concat", [g.op("Neg", [x2], f"{name}_neg"), x1], f"{name}_rot", axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos], f"{name}_c"), g.op("Mul", [rot, sin], f"{name}_s")], f"{name}_rope")

    def attention(self, x: str, i: int, cos: str, sin: str, mask: str | None, dims: dict[str, str]) -> str:
        g, cfg, attn = self.g, self.cfg, self.m.layers[i].self_attn
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        p = f"layers.{i}.self_attn"

        def heads(t: str, n: int, nm: str) -> str:  # [M, n*D] -> [B, n, T, D]
            r = g.op(
                "Reshape",
                [t, g.op("Concat", [dims["B"], dims["T"], g.const([n, D], np.int64)], f"{nm}_shp", axis=0)],
                f"{nm}_4d",
            )
            return g.op("Transpose", [r], f"{nm}_bhtd", perm=[0, 2, 1, 3])

        q = self.rope(heads(self.linear(x, attn.q_proj, f"{p}.q_proj"), H, f"{p}_q"), cos, sin, f"{p}_q")
        k = self.rope(heads(self.linear(x, attn.k_proj, f"{p}.k_proj"), Hkv, f"{p}_k"), cos, sin, f"{p}_k")
        v = heads(self.linear(x, attn.v_proj, f"{p}.v_proj"), Hkv, f"{p}_v")
        pk = g.op("Concat", [f"past_key_values.{i}.key", k], f"present.{i}.key", axis=2)
        pv = g.op("Concat", [f"past_key_values.{i}.value", v], f"present.{i}.value", axis=2)
        # GQA without repeating k/v: q [B, Hkv, G, T, D] against k/v [B, Hkv, 1, S, D]
        q5 = g.op("Reshape", [q, g.const([0, Hkv, H // Hkv, -1, D], np.int64)], f"{p}_q5")
        k5 = g.op("Unsqueeze", [pk, g.const([2], np.int64)], f"{p}_k5")
        v5 = g.op("Unsqueeze", [pv, g.const([2], np.int64)], f"{p}_v5")
        kt = g.op("Transpose", [k5], f"{p}_kt", perm=[0, 1, 2, 4, 3])
        scores = g.op("Mul", [g.op("MatMul", [q5, kt], f"{p}_qk"), g.const(1.0 / math.sqrt(D))], f"{p}_scores")
        if mask is not None:
            scores = g.op("Where", [mask, scores, g.const(-np.inf)], f"{p}_masked")
        probs = g.op("Softmax", [scores], f"{p}_probs", axis=-1)
        o = g.op("MatMul", [probs, v5], f"{p}_o5")
        o = g.op(
            "Transpose",
            [g.op("Reshape", [o, g.const([0, H, -1, D], np.int64)], f"{p}_o4")],
            f"{p}_obthd",
            perm=[0, 2, 1, 3],
        )
        o = g.op("Reshape", [o, g.const([-1, H * D], np.int64)], f"{p}_o2d")
        return self.linear(o, attn.o_proj, f"{p}.o_proj")

    def mlp(self, x: str, i: int) -> str:
        g, mlp, p = self.g, self.m.layers[i].mlp, f"layers.{i}.mlp"
        gate = self.linear(x, mlp.gate_proj, f"{p}.gate_proj")
        up = self.linear(x, mlp.up_proj, f"{p}.up_proj")
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}_sig")], f"{p}_silu")
        return self.linear(g.op("Mul", [act, up], f"{p}_act"), mlp.down_proj, f"{p}.down_proj")

    def lm_head(self, x: str) -> str:
        from quant.linear import FP8Embedding, FP8Linear

        emb, head = self.m.embed_tokens, self.m.lm_head
        if isinstance(head, FP8Linear) and isinstance(emb, FP8Embedding) and head.weight is emb.weight:
            self._note("fp8 lm_head (tied)", "lm_head")  # the DQ of the shared table is memoized: one node
        return self.linear(x, head, "lm_head")

    def _dims(self) -> dict[str, str]:
        """The batch and step sizes of ``input_ids`` as 1-element int64 tensors: {"B": ..., "T": ...}."""
        g = self.g
        shp = g.op("Shape", ["input_ids"], "ids_shape")
        return {
            "B": g.op("Slice", [shp, g.const([0], np.int64), g.const([1], np.int64)], "dim_B"),
            "T": g.op("Slice", [shp, g.const([1], np.int64), g.const([2], np.int64)], "dim_T"),
        }

    def _rope_tables(self) -> tuple[str, str]:
        """The rotary tables cos/sin [B, 1, T, D] from the positions (engine/core/model.py rope_cos_sin)."""
        g, TP = self.g, self.g.TP
        pos = g.op("Unsqueeze", [g.op("Cast", ["positions"], "pos_f", to=TP.FLOAT), g.const([-1], np.int64)], "pos3")
        freqs = g.op("Mul", [pos, g.tensor(self.m.inv_freq, "inv_freq")], "freqs")
        emb = g.op(
            "Unsqueeze", [g.op("Concat", [freqs, freqs], "rope_emb", axis=-1), g.const([1], np.int64)], "rope_emb4"
        )
        return g.op("Cos", [emb], "rope_cos"), g.op("Sin", [emb], "rope_sin")

    def _position_mask(self, dims: dict[str, str]) -> str:
        """The position mask [B, 1, 1, T, S]: slot j visible to position p iff j <= p (and p - j < window)."""
        g, cfg = self.g, self.cfg
        past_shape = g.op("Shape", ["past_key_values.0.key"], "past_shape")
        past = g.op("Slice", [past_shape, g.const([2], np.int64), g.const([3], np.int64)], "dim_past")
        total = g.op("Add", [past, dims["T"]], "dim_total")
        j = g.op("Range", [g.const(0, np.int64), g.op("Squeeze", [total], "total_s"), g.const(1, np.int64)], "slots")
        p5 = g.op("Unsqueeze", ["positions", g.const([1, 2, 4], np.int64)], "pos5")
        mask = g.op("LessOrEqual", [j, p5], "visible")
        if cfg.sliding_window is not None:
            lo = g.op("Sub", [p5, g.const(cfg.sliding_window, np.int64)], "window_lo")
            mask = g.op("And", [mask, g.op("Greater", [j, lo], "in_window")], "visible_w")
        return mask

    def _decoder_layer(self, x: str, i: int, rope: tuple[str, str], mask: str, dims: dict[str, str]) -> str:
        """Layer ``i``: x + attention(norm(x)), then + mlp(norm(.))."""
        g, blk, p = self.g, self.m.layers[i], f"layers.{i}"
        a = self.attention(self.rms_norm(x, blk.input_layernorm, f"{p}.input_layernorm"), i, *rope, mask, dims)
        x = g.op("Add", [x, a], f"{p}_h")
        f = self.mlp(self.rms_norm(x, blk.post_attention_layernorm, f"{p}.post_attention_layernorm"), i)
        return g.op("Add", [x, f], f"{p}_out")

    def _logits(self, x: str, dims: dict[str, str]) -> str:
        """The final norm and the LM head, reshaped to logits [B, T, V]."""
        g = self.g
        logits2d = self.lm_head(self.rms_norm(x, self.m.norm, "norm"))
        shape = g.op("Concat", [dims["B"], dims["T"], g.const([self.cfg.vocab_size], np.int64)], "logits_shp", axis=0)
        return g.op("Reshape", [logits2d, shape], "logits")

    def _model_proto(self, logits: str) -> Any:
        """The ModelProto of the nodes emitted so far, with the step's inputs and outputs (module docstring)."""
        cfg, h, TP = self.cfg, self.g.h, self.g.TP
        L, Hkv, D, V = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
        kv_in = [
            h.make_tensor_value_info(f"past_key_values.{i}.{w}", TP.FLOAT, ["batch", Hkv, "past_seq", D])
            for i in range(L)
            for w in ("key", "value")
        ]
        kv_out = [
            h.make_tensor_value_info(f"present.{i}.{w}", TP.FLOAT, ["batch", Hkv, "total_seq", D])
            for i in range(L)
            for w in ("key", "value")
        ]
        inputs = [
            h.make_tensor_value_info("input_ids", TP.INT64, ["batch", "step"]),
            h.make_tensor_value_info("positions", TP.INT64, ["batch", "step"]),
        ] + kv_in
        outputs = [h.make_tensor_value_info(logits, TP.FLOAT, ["batch", "step", V])] + kv_out
        graph = h.make_graph(self.g.nodes, "specmix_step", inputs, outputs, self.g.inits)
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET)], producer_name="specmix")
        model.ir_version = IR_VERSION
        return model

    def build(self) -> Any:
        assert self.m is not None and self.cfg is not None, "build() needs a model"
        g = self.g
        dims = self._dims()
        x = self.embed(g.op("Reshape", ["input_ids", g.const([-1], np.int64)], "ids_flat"))
        rope = self._rope_tables()
        mask = self._position_mask(dims)
        for i in range(self.cfg.num_hidden_layers):
            x = self._decoder_layer(x, i, rope, mask, dims)
        return self._model_proto(self._logits(x, dims))


def build_step_graph(model: Transformer) -> tuple[Any, dict[str, list[str]]]:
    """(the ONNX ModelProto of one step of ``model``, {quantization kind: module names}).

    Refuses with InvalidConfigError naming the module a kernel or module type with no ONNX form.
    """
    b = _StepBuilder(model)
    with torch.no_grad():
        proto = b.build()
    return proto, {k: sorted(v) for k, v in sorted(b.quant.items())}


def build_linear_graph(mod: nn.Module, name: str = "linear") -> Any:
    """A graph of one (quantized) Linear: x [M, in] -> y [M, out], plus ``xq``, the quantized
    activation, for the kernels that quantize it (w8a8, native). For checking the Q/DQ
    arithmetic against specmix's module on the same inputs."""
    from quant.linear import FP8Linear, Int8Linear

    b = _StepBuilder(None)
    g, h, TP = b.g, b.g.h, b.g.TP
    with torch.no_grad():
        y = b.linear("x", mod, name)
    outs = [h.make_tensor_value_info(y, TP.FLOAT, ["m", int(mod.out_features)])]
    qdq = (isinstance(mod, Int8Linear) and mod.kernel == "w8a8") or (
        isinstance(mod, FP8Linear) and mod.kernel == "native"
    )
    if qdq:
        elem = TP.INT8 if isinstance(mod, Int8Linear) else TP.FLOAT8E4M3FN
        outs.append(h.make_tensor_value_info(f"{name}_xq", elem, ["m", int(mod.in_features)]))
    x = h.make_tensor_value_info("x", TP.FLOAT, ["m", int(mod.in_features)])
    graph = h.make_graph(g.nodes, f"{name}_graph", [x], outs, g.inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET)], producer_name="specmix")
    model.ir_version = IR_VERSION
    return model
