"""Export specmix models as ONNX graphs of one decode/verify step, and check them against specmix.

    from engine.export.onnx_export import export_step, OnnxStep, decode_parity

    info = export_step(model, "out/target.onnx")                 # checker-validated, written atomically
    step = OnnxStep("out/target.onnx")                           # onnxruntime, CPU
    logits, cache = step(input_ids, positions, step.empty_cache(batch))   # prefill (past_seq = 0)
    logits, cache = step(next_ids, next_positions, cache)                  # decode / verify step
    report = decode_parity(model, step, prompt, steps=8, reference=fp32_model)

The graph (engine/export/onnx_graph.py) takes ``input_ids`` and ``positions`` [batch, step] and the
past keys/values of every layer [batch, kv_heads, past_seq, head_dim] and returns ``logits``
[batch, step, vocab] and the present keys/values (past ++ new); the caller keeps the cache.

Quantization (the module docstring of engine/export/onnx_graph.py has the node patterns):
- INT8 FFN (Int8Linear, kernel w8a8): int8 weights + per-channel scales -> DequantizeLinear;
  activations: per-token dynamic symmetric int8 QuantizeLinear/DequantizeLinear with specmix's
  scale rule, after the SmoothQuant divide. This is the W8A8 arithmetic of specmix, not a
  weight-only approximation; what differs is that the int8 products are summed in float32
  after DequantizeLinear (specmix sums them in int32), a rounding-level difference.
- FP8 draft (FP8Linear / FP8Embedding): the e4m3 weights are FLOAT8E4M3FN initializers,
  bit-identical to specmix's, dequantized by DequantizeLinear (opset 21, per-axis), which
  onnxruntime runs on the CPU. The embedding table is dequantized before its Gather (ONNX's
  Gather has no float8 type). The "native" kernel adds per-token e4m3 Q/DQ of the activation.
- Not exportable (InvalidConfigError naming the module): the llm-int8 and te kernels.

Everything computes in float32; a model loaded in fp16/bf16 is exported with its weights cast
to float32 (exactly), so its ONNX logits follow the fp32 arithmetic, not the fp16 one.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.core.errors import InvalidConfigError, UnsupportedArchitectureError
from engine.core.model import KVCache, Transformer
from engine.export.onnx_graph import (
    IR_VERSION,
    OPSET,
    build_linear_graph,
    build_step_graph,
)

log = logging.getLogger(__name__)

# a quantized graph passes when its diff to specmix is within these fractions of the quantization error
QUANT_MAX_FRACTION, QUANT_MEAN_FRACTION = 1.0, 0.2
# one protobuf is limited to 2 GiB: larger models keep their weights in <name>.onnx.data
EXTERNAL_DATA_BYTES = 1 << 30


def _require(module: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise InvalidConfigError(
            f"{what} needs the Python package {module!r}: pip install -e '.[onnx]' (onnx>=1.16, onnxruntime>=1.18)"
        ) from None


def check_exportable(model: Transformer) -> None:
    """Refuse (UnsupportedArchitectureError naming the field) what the step graph does not express."""
    cfg = model.config
    if cfg.head_dim % 2:
        raise UnsupportedArchitectureError(
            f"head_dim={cfg.head_dim} is odd: the rotary embedding needs an even head_dim"
        )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise UnsupportedArchitectureError(
            f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )


def graph_io(model: Transformer) -> dict[str, Any]:
    """The inputs and outputs of the step graph, for the manifest."""
    cfg = model.config
    kv = ["batch", cfg.num_key_value_heads, "past_seq", cfg.head_dim]
    kvo = ["batch", cfg.num_key_value_heads, "total_seq", cfg.head_dim]
    ins = {
        "input_ids": {"dtype": "int64", "shape": ["batch", "step"]},
        "positions": {"dtype": "int64", "shape": ["batch", "step"]},
    }
    outs = {"logits": {"dtype": "float32", "shape": ["batch", "step", cfg.vocab_size]}}
    for i in range(cfg.num_hidden_layers):
        for w in ("key", "value"):
            ins[f"past_key_values.{i}.{w}"] = {"dtype": "float32", "shape": kv}
            outs[f"present.{i}.{w}"] = {"dtype": "float32", "shape": kvo}
    return {"inputs": ins, "outputs": outs}


def build_model(model: Transformer) -> tuple[Any, dict[str, list[str]]]:
    """(checked ONNX ModelProto of one step, {quantization kind: module names})."""
    onnx = _require("onnx", "ONNX export")
    check_exportable(model)
    proto, quant = build_step_graph(model)
    if proto.ByteSize() < EXTERNAL_DATA_BYTES:
        onnx.checker.check_model(proto, full_check=True)
    return proto, quant


def export_step(model: Transformer, path: str | Path) -> dict[str, Any]:
    """Write ``model``'s step graph to ``path`` atomically; returns its manifest entry.

    The file (and, above 1 GiB of weights, its ``<name>.data`` beside it) is written in a
    temporary directory next to ``path`` and renamed into place, then checked by
    ``onnx.checker.check_model`` on the path.
    """
    onnx = _require("onnx", "ONNX export")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    proto, quant = build_model(model)
    external = proto.ByteSize() >= EXTERNAL_DATA_BYTES
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        data_name = f"{path.name}.data"
        onnx.save_model(
            proto,
            str(tmp / path.name),
            save_as_external_data=external,
            all_tensors_to_one_file=True,
            location=data_name if external else None,
        )
        if external:
            os.replace(tmp / data_name, path.parent / data_name)
        os.replace(tmp / path.name, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    onnx.checker.check_model(str(path), full_check=True)
    cfg = model.config
    log.info(
        "wrote %s (%d layers, vocab %d, %d bytes)", path, cfg.num_hidden_layers, cfg.vocab_size, path.stat().st_size
    )
    return {
        "file": path.name,
        "external_data": data_name if external else None,
        "opset": OPSET,
        "ir_version": IR_VERSION,
        **graph_io(model),
        "quantization": quant,
        "config": {
            k: getattr(cfg, k)
            for k in (
                "architecture",
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "tie_word_embeddings",
                "sliding_window",
            )
        },
    }


class OnnxStep:
    """An onnxruntime CPU session of a step graph; the caller keeps the cache (a list of arrays)."""

    def __init__(self, model: str | Path | Any, threads: int = 1, kind: str = "step") -> None:
        ort = _require("onnxruntime", "running an ONNX export")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        # Run the Q/DQ nodes as written. onnxruntime's QDQ -> integer-kernel fusions assume per-tensor
        # activation scales: 1.19 turns the per-token DQ -> Gemm into a QGemm that then refuses its
        # scale at run time (1.32 leaves it alone). Other consumers of the file: set this entry too.
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
        src = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
        self.session = ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
        self.cache_names = [i.name for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        self.kv_shape = self.session.get_inputs()[2].shape if kind == "step" else None  # [batch, Hkv, past_seq, D]

    def empty_cache(self, batch: int) -> list[np.ndarray]:
        _, hkv, _, d = self.kv_shape
        return [np.zeros((batch, hkv, 0, d), np.float32) for _ in self.cache_names]

    def __call__(
        self, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray | torch.Tensor, cache: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(logits [B, T, V], the present cache) for one step."""
        feeds = {"input_ids": np.asarray(input_ids, np.int64), "positions": np.asarray(positions, np.int64)}
        feeds.update(zip(self.cache_names, cache))
        out = self.session.run(None, feeds)
        return out[0], out[1:]


@dataclass
class Parity:
    """Logit differences over a prefill, ``steps`` greedy decode steps and an optional verify step.

    ``max_*`` / ``mean_*``: ONNX against specmix (the same model, as planned). ``ref_*``: specmix
    as planned against the unquantized reference: the quantization error. ``floor_*``: specmix as
    planned against itself with the outputs of its embedding and RMSNorms moved by one ulp (a
    random direction per element): how far float32 rounding alone moves this model's logits.

    An unquantized model's floor is ~1e-6. A quantized one's is orders larger: a rounding-level
    change of an activation that sits on a rounding boundary of its per-token quantization moves
    it a whole quantization step, and the next layers amplify it. onnxruntime's float32 kernels
    (Gemm, Softmax, ReduceMean) round differently from torch's in many places at once, so an
    exact Q/DQ graph still lands somewhat above a single one-ulp floor. A quantized export is
    therefore held to its quantization error here (``passed``), and its Q/DQ arithmetic to
    specmix's, module by module on identical inputs, by :func:`module_parity`.
    """

    steps: int
    max_abs: float  # max |onnx - specmix| over every logit compared
    mean_abs: float
    max_rel: float  # max_abs / max |specmix logits|
    logit_scale: float  # max |specmix logits|
    argmax_agree: float = 1.0  # share of positions where ONNX and specmix pick the same token
    ref_max_abs: float | None = None
    ref_mean_abs: float | None = None
    floor_max_abs: float | None = None
    floor_mean_abs: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def passed(self, max_rel: float = 1e-3) -> bool:
        """Within ``max_rel`` of the logit scale, or (a quantized model, ``ref_*`` measured) within its
        quantization error: max |diff| <= the error's max and mean |diff| <= a fifth of its mean."""
        if self.max_rel <= max_rel:
            return True
        return (
            self.ref_max_abs is not None
            and self.ref_mean_abs is not None
            and self.max_abs <= QUANT_MAX_FRACTION * self.ref_max_abs
            and self.mean_abs <= QUANT_MEAN_FRACTION * self.ref_mean_abs
        )


def _flat(logits: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in logits])


def specmix_decode(
    model: Transformer,
    prompt: torch.Tensor,
    steps: int,
    tokens: list[torch.Tensor] | None = None,
    verify: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """specmix logits of a prefill of ``prompt`` [B, T0], ``steps`` decode steps, then ``verify`` [B, K].

    The decode steps feed ``tokens`` ([B] each) or, when None, the greedy choices.
    Returns (float32 logits of each step on the CPU, the tokens fed).
    """
    B, T0 = prompt.shape
    dev = model.norm.weight.device
    cache = KVCache(model.config, B, T0 + steps + (0 if verify is None else verify.shape[1]), model.dtype, dev)
    fed = list(tokens) if tokens is not None else []
    with torch.no_grad():
        out = [model(prompt.to(dev), torch.arange(T0, device=dev).expand(B, T0), cache, kv_len=T0).float().cpu()]
        for i in range(steps):
            if tokens is None:
                fed.append(out[-1][:, -1].argmax(-1))
            ip = torch.full((B, 1), T0 + i, device=dev)
            out.append(model(fed[i][:, None].to(dev), ip, cache, kv_len=T0 + i + 1).float().cpu())
        if verify is not None:
            K, pos = verify.shape[1], T0 + steps
            ip = (pos + torch.arange(K, device=dev)).expand(B, K)
            out.append(model(verify.to(dev), ip, cache, kv_len=pos + K).float().cpu())
    return out, fed


def _one_ulp_floor(
    model: Transformer, prompt: torch.Tensor, steps: int, tokens: list[torch.Tensor], verify: torch.Tensor | None
) -> list[torch.Tensor]:
    """specmix_decode with the output of the embedding and of every RMSNorm moved one ulp up or down
    (a seeded random direction per element): rounding-level noise where each sublayer starts."""
    from engine.core.model import RMSNorm

    g = torch.Generator().manual_seed(1)

    def hook(_mod: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        up = torch.randint(0, 2, out.shape, generator=g).bool().to(out.device)
        return torch.nextafter(out, torch.where(up, torch.inf, -torch.inf).to(out.dtype))

    mods = [model.embed_tokens] + [m for m in model.modules() if isinstance(m, RMSNorm)]
    handles = [m.register_forward_hook(hook) for m in mods]
    try:
        return specmix_decode(model, prompt, steps, tokens, verify)[0]
    finally:
        for h in handles:
            h.remove()


def decode_parity(
    model: Transformer,
    step: OnnxStep,
    prompt: torch.Tensor,
    steps: int = 8,
    reference: Transformer | None = None,
    verify: int = 0,
    floor: bool = False,
) -> Parity:
    """Compare ONNX with specmix over a prefill of ``prompt`` [B, T0] and ``steps`` greedy decode steps.

    Tokens are specmix's greedy choices (fed to both). ``verify`` > 0 appends one multi-token
    step of that many random tokens over the cache (a speculative verify). With ``reference``
    (the unquantized model) the quantization error is measured too; with ``floor`` the
    one-ulp sensitivity of specmix itself (see Parity).
    """
    if steps < 0 or verify < 0 or prompt.dim() != 2 or prompt.shape[1] == 0:
        raise InvalidConfigError(
            f"steps={steps}, verify={verify}, prompt shape {tuple(prompt.shape)}: allowed "
            "steps >= 0, verify >= 0 and a prompt [batch, >= 1]"
        )
    B, T0 = prompt.shape
    g = torch.Generator().manual_seed(0)
    ver = torch.randint(0, model.config.vocab_size, (B, verify), generator=g) if verify else None
    ours, tokens = specmix_decode(model, prompt, steps, None, ver)
    cache = step.empty_cache(B)
    got = []
    lg_o, cache = step(prompt.numpy(), np.broadcast_to(np.arange(T0), (B, T0)), cache)
    got.append(torch.from_numpy(lg_o))
    for i, t in enumerate(tokens):
        lg_o, cache = step(t[:, None].numpy(), np.full((B, 1), T0 + i), cache)
        got.append(torch.from_numpy(lg_o))
    if ver is not None:
        p = T0 + steps + np.arange(verify)
        lg_o, cache = step(ver.numpy(), np.broadcast_to(p, (B, verify)), cache)
        got.append(torch.from_numpy(lg_o))
    a, o = _flat(ours), _flat(got)
    scale, d = float(a.abs().max()), (a - o).abs()
    res = Parity(
        steps=steps,
        max_abs=float(d.max()),
        mean_abs=float(d.mean()),
        max_rel=float(d.max()) / scale,
        logit_scale=scale,
        argmax_agree=float((a.argmax(-1) == o.argmax(-1)).float().mean()),
    )
    if reference is not None:
        r = (a - _flat(specmix_decode(reference, prompt, steps, tokens, ver)[0])).abs()
        res.ref_max_abs, res.ref_mean_abs = float(r.max()), float(r.mean())
    if floor:
        f = (a - _flat(_one_ulp_floor(model, prompt, steps, tokens, ver))).abs()
        res.floor_max_abs, res.floor_mean_abs = float(f.max()), float(f.mean())
    return res


def module_parity(model: Transformer, prompt: torch.Tensor) -> dict[str, Any]:
    """Each quantized Linear of ``model`` as a one-node-chain ONNX graph, fed the very inputs the
    module sees in a specmix forward of ``prompt``: the worst output difference relative to the
    output's scale, and how many quantized activations differ from specmix's (w8a8, native)."""
    from quant.fp8 import quantize_fp8_rowwise
    from quant.int8 import quantize_int8_rowwise
    from quant.linear import FP8Linear, Int8Linear

    mods = {n: m for n, m in model.named_modules() if isinstance(m, (Int8Linear, FP8Linear))}
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(lambda _m, args, n=n: seen.setdefault(n, args[0].detach())) for n, m in mods.items()
    ]
    try:
        with torch.no_grad():
            model(prompt.to(model.norm.weight.device))
    finally:
        for hk in hooks:
            hk.remove()
    worst, differ, total = 0.0, 0, 0
    for n, m in mods.items():
        x = seen[n].reshape(-1, m.in_features).float()
        with torch.no_grad():
            y = m(x.to(m.weight.device, model.dtype)).float().cpu()
        res = OnnxStep(build_linear_graph(m, "lin"), kind="linear").session.run(None, {"x": x.cpu().numpy()})
        worst = max(worst, float((torch.from_numpy(res[0]) - y).abs().max() / y.abs().max().clamp(min=1e-30)))
        if len(res) > 1:
            xs = x.cpu() if m.smooth is None else x.cpu() / m.smooth.cpu()
            if isinstance(m, Int8Linear):
                q = quantize_int8_rowwise(xs)[0].numpy()
                got = res[1]
            else:  # e4m3: compare the bytes
                q = quantize_fp8_rowwise(xs)[0].view(torch.uint8).numpy()
                got = np.asarray(res[1]).view(np.uint8)
            differ += int((q != got).sum())
            total += q.size
    return {
        "modules": len(mods),
        "max_rel": worst,
        "quantized_activations": total,
        "quantized_activations_differing": differ,
    }
