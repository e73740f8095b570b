"""Apply a ModelPlan to a loaded ``engine.core.model.Transformer`` by module swap.

    target = apply_plan(target, plan.target, calib=collect_activation_stats(target, calib_batches))
    draft = apply_plan(draft, plan.draft)

Every kernel the plan names is checked against the model's device first
(KernelUnavailableError, nothing swapped). A tied target keeps its fp16 table
shared by embed_tokens and lm_head; a tied FP8 draft shares one e4m3 table (and
its per-row scales) between FP8Embedding and the FP8 LM head. After the swap the
remaining float parameters (norms, dense Linears, biases) are cast to the plan's
compute dtype; quantized data and scales keep their dtypes. A dense Linear whose family is stored narrower
than the compute dtype (a CPU plan's fp16 attention and LM head) becomes a StoredLinear, its weight rounded to that
dtype, and such an embedding table a StoredEmbedding (a tied pair shares the one 16-bit table).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from engine.core.errors import InvalidConfigError
from engine.core.model import Transformer
from engine.core.stored_linear import StoredEmbedding, StoredLinear

from .linear import FP8Embedding, FP8Linear, Int8Linear
from .matmul_kernels import require_kernel
from .plan_schema import FAMILY_MODULES, FamilyPlan, ModelPlan

log = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _family_of(name: str) -> tuple[int, str, str] | None:
    """'layers.3.mlp.up_proj' -> (3, 'ffn', 'up_proj')."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[2] in ("self_attn", "mlp"):
        fam = "attention" if parts[2] == "self_attn" else "ffn"
        if parts[3] in FAMILY_MODULES[fam]:
            return int(parts[1]), fam, parts[3]
    return None


def _quantize_linear(linear: nn.Linear, fam: FamilyPlan, act_absmax: Tensor | None) -> nn.Module:
    if fam.storage == "fp8_e4m3":
        return FP8Linear.from_float(linear, kernel=fam.kernel)
    if fam.storage == "int8":
        kw: dict = {"group_size": fam.scaling.get("group_size")}
        if fam.kernel == "llm-int8":
            kw["outlier_threshold"] = float(fam.scaling.get("outlier_threshold", 6.0))
        alpha = fam.scaling.get("smoothquant_alpha")
        if act_absmax is not None:
            kw["alpha"] = float(alpha)
        return Int8Linear.from_float(linear, kernel=fam.kernel, act_absmax=act_absmax, **kw)
    return linear


def _check_model(model: Transformer, plan: ModelPlan) -> None:
    cfg = model.config
    for key, want in plan.model.items():
        have = getattr(cfg, key, None)
        if have != want:
            raise InvalidConfigError(
                f"plan.{plan.role}.model.{key}={want!r} but the model has {have!r}: the plan was made for another model"
            )


def _check_calib(model: Transformer, want: list[str], calib: dict[str, Tensor] | None, smooth: list[str]) -> None:
    """Every Linear that SmoothQuant smooths needs its activation absmax [in_features]."""
    calib = calib or {}
    missing = [n for n in want if n not in calib]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise InvalidConfigError(
            f"calib is missing {missing[0]}{more}: the plan asks for SmoothQuant on "
            f"{', '.join(smooth)}; pass calib=collect_activation_stats(model, batches)"
        )
    for n in want:
        k = model.get_submodule(n).in_features
        if tuple(calib[n].shape) != (k,):
            raise InvalidConfigError(f"calib[{n!r}] has shape {tuple(calib[n].shape)}; expected ({k},)")


def store_narrow(model: Transformer, model_plan: ModelPlan) -> int:
    """Swap each dense Linear that ``model_plan`` stores in 16 bits while computing in fp32 (a CPU plan's fp16
    attention and LM head) for a StoredLinear (its weight rounded to that dtype), and such an embedding table for a
    StoredEmbedding: the part of ``apply_plan`` the planner's
    search measures its trials with. Returns the number swapped; Linears already swapped are left alone."""
    if model_plan.compute_dtype != "fp32":
        return 0
    n_swapped = 0
    with torch.no_grad():
        for n, m in list(model.named_modules()):
            where = _family_of(n)
            if type(m) is not nn.Linear or where is None:
                continue
            fam = model_plan.module_plan(n, where[1])
            if _narrow(fam):
                parent = model.get_submodule(n.rsplit(".", 1)[0])
                setattr(parent, where[2], StoredLinear.from_linear(m, TORCH_DTYPES[fam.storage]))
                n_swapped += 1
    return n_swapped + _store_verifier(model, model_plan)


def _narrow(fam: FamilyPlan) -> bool:
    return not fam.quantized and fam.storage in ("fp16", "bf16")


def _store_verifier(model: Transformer, model_plan: ModelPlan) -> int:
    """The embedding table and LM head stored as the plan says when that is 16 bits (a CPU plan's fp16 verifier);
    a tied pair keeps one table. Returns the number of modules swapped."""
    emb, head = model_plan.families["embeddings"], model_plan.families["lm_head"]
    n_swapped = 0
    if type(model.embed_tokens) is nn.Embedding and _narrow(emb):
        tied = model.lm_head.weight is model.embed_tokens.weight
        model.embed_tokens = StoredEmbedding.from_embedding(model.embed_tokens, TORCH_DTYPES[emb.storage])
        n_swapped += 1
        if tied:
            model.lm_head = StoredLinear(model.embed_tokens.weight, None)
            return n_swapped + 1
    if type(model.lm_head) is nn.Linear and _narrow(head):
        model.lm_head = StoredLinear.from_linear(model.lm_head, TORCH_DTYPES[head.storage])
        n_swapped += 1
    return n_swapped


def apply_plan(model: Transformer, model_plan: ModelPlan, calib: dict[str, Tensor] | None = None) -> Transformer:
    """Swap the model's modules in place as ``model_plan`` (``plan.target`` or ``plan.draft``) says.

    ``calib``: per-input-channel activation absmax of each FFN Linear (see
    :func:`collect_activation_stats`), required when the plan asks for SmoothQuant.
    """
    if not isinstance(model_plan, ModelPlan):
        raise InvalidConfigError(
            f"model_plan must be a ModelPlan (plan.target or plan.draft), got {type(model_plan).__name__}"
        )
    _check_model(model, model_plan)
    fams = model_plan.families
    device = model.norm.weight.device
    for f in ("embeddings", "lm_head"):
        if fams[f].storage == "int8":
            raise InvalidConfigError(
                f"plan.{model_plan.role}.{f}.storage='int8' is not supported: allowed fp16, bf16, fp32, fp8_e4m3"
            )
    for fam in model_plan.all_plans():
        if fam.quantized:
            require_kernel("fp8" if fam.storage == "fp8_e4m3" else "int8", fam.kernel, device)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and _family_of(n)]
    plans = {n: model_plan.module_plan(n, _family_of(n)[1]) for n in names}  # type: ignore[index]
    smooth = [n for n in names if plans[n].quantized and plans[n].scaling.get("smoothquant_alpha") is not None]
    smooth_fams = sorted({_family_of(n)[1] for n in smooth})  # type: ignore[index]
    _check_calib(model, smooth, calib, smooth_fams)
    store_narrow(model, model_plan)
    with torch.no_grad():
        for n in names:
            _, fam_name, leaf = _family_of(n)  # type: ignore[misc]
            fam = plans[n]
            if not fam.quantized:
                continue
            parent = model.get_submodule(n.rsplit(".", 1)[0])
            act = calib[n] if (calib is not None and n in smooth) else None
            setattr(parent, leaf, _quantize_linear(getattr(parent, leaf), fam, act))
        emb, head = fams["embeddings"], fams["lm_head"]
        tied = model.lm_head.weight is model.embed_tokens.weight
        if emb.storage == "fp8_e4m3":
            model.embed_tokens = FP8Embedding.from_float(model.embed_tokens)
        if head.storage == "fp8_e4m3":
            if tied and isinstance(model.embed_tokens, FP8Embedding):
                model.lm_head = FP8Linear.tied_to(model.embed_tokens, kernel=head.kernel)
            else:
                model.lm_head = FP8Linear.from_float(model.lm_head, kernel=head.kernel)
        model.to(TORCH_DTYPES[model_plan.compute_dtype])
    log.info(
        "applied %s plan: %s%s",
        model_plan.role,
        ", ".join(f"{f}={p.storage}/{p.kernel}" for f, p in fams.items()),
        f" and {len(model_plan.modules)} per-layer choices" if model_plan.modules else "",
    )
    return model


def collect_activation_stats(
    model: Transformer, token_batches: Iterable[Tensor], families: tuple[str, ...] = ("ffn",)
) -> dict[str, Tensor]:
    """Per-input-channel absmax (float32, on the CPU) of each planned-family Linear's input.

    ``token_batches``: LongTensors [B, T] (or [T]) run through the unquantized model
    with forward hooks. Keys are module names, e.g. ``layers.0.mlp.down_proj``.
    """
    stats: dict[str, Tensor] = {}
    hooks = []

    def hook(name: str):
        def fn(_mod: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0].detach()
            a = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float().cpu()
            stats[name] = a if name not in stats else torch.maximum(stats[name], a)

        return fn

    for n, m in model.named_modules():
        f = _family_of(n)
        if f is not None and f[1] in families and isinstance(m, nn.Linear):
            hooks.append(m.register_forward_pre_hook(hook(n)))
    if not hooks:
        raise InvalidConfigError(f"families={families!r} match no unquantized Linear of the model")
    device = model.norm.weight.device
    seen = 0
    try:
        with torch.no_grad():
            for toks in token_batches:
                toks = toks if toks.dim() == 2 else toks[None]
                model(toks.to(device))
                seen += toks.numel()
    finally:
        for h in hooks:
            h.remove()
    if seen == 0:
        raise InvalidConfigError("token_batches is empty: calibration needs at least one token")
    return stats


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and persistent buffer, each storage counted once (tied tables)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    tensors = list(model.parameters()) + [b for n, b in model.named_buffers() if not n.endswith("inv_freq")]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
