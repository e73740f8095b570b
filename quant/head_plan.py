"""The precision plan's draft part for a trained draft head (engine/spec_decode/heads/), and its module swap.

A head is the draft, so the draft plan applies to it; what it shares with the target stays the
verifier's: the LM head it scores with and the embedding table it reads are the target's, never
quantized here (the plan's ``lm_head`` and ``embeddings`` families say so).

- eagle: its Linears (``fc``, ``gate_up.<i>``, ``down.<i>``; with attention ``fc`` and each decoder layer's
  projections) become ``FP8Linear`` (per-output-channel e4m3, the draft's FP8 kernel), as a draft model's
  Linears do; its RMSNorms stay in the compute dtype.
- eagle3: ``fc`` (3H -> H) and its decoder layer's projections (``midlayer.self_attn.{q,k,v,o}_proj``,
  ``midlayer.mlp.*``) become ``FP8Linear``; its own reduced-vocabulary LM head (the drafter's scorer) and norms
  stay in the compute dtype.
- medusa: kept in the compute dtype (the ``ffn`` family says why): its weights are one stacked
  [layers, heads, H, H] tensor applied by one batched matmul, while the FP8 GEMM (``torch._scaled_mm``)
  is one 2-D matrix per call; an FP8 form would split it into per-head GEMMs and change the head's
  checkpoint layout, for the heads that are a small part of a round's cost next to the shared LM head.

The plan's ``model`` holds the head's shape (checked at apply) and ``ModelPlan.head`` its kind.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from engine.core.errors import InvalidConfigError

from .linear import FP8Linear
from .matmul_kernels import require_kernel
from .plan_schema import HEAD_KINDS, FamilyPlan, ModelPlan

log = logging.getLogger(__name__)

HEAD_SHAPE_KEYS = ("hidden_size", "vocab_size", "layers", "intermediate_size", "num_heads", "draft_vocab")
ATTENTION_KEYS = ("attention", "attention_heads", "kv_heads", "head_dim")  # the EAGLE head with attention
MEDUSA_KEPT = (
    "kept in the compute dtype: one stacked [layers, heads, H, H] weight in a batched matmul "
    "(the FP8 GEMM takes one 2-D matrix per call; per-head GEMMs would change the head's checkpoint layout)"
)
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def head_shape(head_config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(kind, the plan's ``model`` dict) from a head's config (``dataclasses.asdict(HeadConfig)``)."""
    kind = head_config.get("kind")
    if kind not in HEAD_KINDS:
        raise InvalidConfigError(f"draft_head.kind={kind!r} is invalid: allowed {', '.join(HEAD_KINDS)}")
    missing = [k for k in HEAD_SHAPE_KEYS if k not in head_config]
    if missing:
        raise InvalidConfigError(
            f"draft_head.{missing[0]} is missing (a head's config has {', '.join(HEAD_SHAPE_KEYS)})"
        )
    shape = {k: head_config[k] for k in HEAD_SHAPE_KEYS}
    if head_config.get("attention") or kind == "eagle3":
        missing = [k for k in ATTENTION_KEYS if k not in head_config]
        if missing:
            raise InvalidConfigError(
                f"draft_head.{missing[0]} is missing (a head with attention has {', '.join(ATTENTION_KEYS)})"
            )
        shape.update({k: head_config[k] for k in ATTENTION_KEYS})
    return str(kind), shape


def head_linears(kind: str, shape: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    """(name, out, in) of each Linear of the head (none for medusa: its weights are stacked)."""
    if kind not in ("eagle", "eagle3"):
        return []
    H = shape["hidden_size"]
    inter = shape["intermediate_size"] or H
    if kind == "eagle3":  # engine/spec_decode/heads/eagle3.py: one layer whose q/k/v read [embedding; feature]
        q, kv = shape["attention_heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
        a, m = "midlayer.self_attn", "midlayer.mlp"
        return [("fc", H, 3 * H), (f"{a}.q_proj", q, 2 * H), (f"{a}.k_proj", kv, 2 * H), (f"{a}.v_proj", kv, 2 * H),
                (f"{a}.o_proj", H, q), (f"{m}.gate_proj", inter, H), (f"{m}.up_proj", inter, H),
                (f"{m}.down_proj", H, inter)]  # fmt: skip
    out = [("fc", H, 2 * H)]
    if shape.get("attention"):  # decoder layers (engine/spec_decode/heads/eagle_attn.py)
        q, kv = shape["attention_heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
        for i in range(shape["layers"]):
            a, m = f"layers.{i}.self_attn", f"layers.{i}.mlp"
            out += [(f"{a}.q_proj", q, H), (f"{a}.k_proj", kv, H), (f"{a}.v_proj", kv, H), (f"{a}.o_proj", H, q)]
            out += [(f"{m}.gate_proj", inter, H), (f"{m}.up_proj", inter, H), (f"{m}.down_proj", H, inter)]
        return out
    for i in range(shape["layers"]):
        out += [(f"gate_up.{i}", 2 * inter, H), (f"down.{i}", H, inter)]
    return out


def head_model_plan(kind: str, shape: dict[str, Any], fp8: FamilyPlan | None, dt: str) -> ModelPlan:
    """The draft part for a head: ``fp8`` (the draft's FP8 family) for its Linears, None: precision.draft_model
    is not fp8."""
    shared = "the target's (shared with the verifier): verifier precision, never quantized"
    linears = [n for n, _, _ in head_linears(kind, shape)]
    if kind == "medusa":
        ffn = FamilyPlan(dt, "dense", {}, MEDUSA_KEPT)
    elif fp8 is None:
        ffn = FamilyPlan(dt, "dense", {"modules": linears}, "precision.draft_model = fp16")
    else:
        ffn = FamilyPlan(fp8.storage, fp8.kernel, {**fp8.scaling, "modules": linears}, "draft head Linears in FP8")
    fams = {
        "attention": FamilyPlan(dt, "dense", {}, "" if shape.get("attention") else "a draft head has no attention"),
        "ffn": ffn,
        "embeddings": FamilyPlan(dt, "dense", {}, f"embedding table {shared}"),
        "lm_head": FamilyPlan(dt, "dense", {}, f"LM head {shared}"),
        "norms": FamilyPlan(dt, "dense", {}, ""),
    }
    return ModelPlan("draft", dt, fams, dict(shape), head=kind)


def head_weight_bytes(kind: str, shape: Mapping[str, Any], plan: ModelPlan | None, compute_bytes: int) -> int:
    """Bytes the planned head stores (shared tables not counted; ``plan`` None: unquantized)."""
    H, L, b = shape["hidden_size"], shape["layers"], compute_bytes
    if kind == "medusa":
        return L * shape["num_heads"] * (H * H + H) * b
    fp8 = plan is not None and plan.families["ffn"].storage == "fp8_e4m3"
    linears = sum(n * k + 4 * n if fp8 else n * k * b for _, n, k in head_linears(kind, shape))
    vocab_ids = 8 * (shape["draft_vocab"] or 0)  # the draft vocabulary's ids (int64)
    if kind == "eagle3":  # four norms and its own LM head (the scorer), in the compute dtype
        return linears + 4 * H * b + (shape["draft_vocab"] or shape["vocab_size"]) * H * b + vocab_ids
    norms = (2 * L + 2 if shape.get("attention") else L + 2) * H * b  # embed_norm, per block / layer, out_norm
    return linears + norms + vocab_ids


def apply_head_plan(head: nn.Module, plan: ModelPlan) -> list[str]:
    """Swap the head's Linears as ``plan`` (a draft part made for a head) says; the names swapped.

    ``head.cfg`` (the head's config) is checked against the plan's ``model``: InvalidConfigError naming the
    first field that differs. The head's remaining float parameters follow the plan's compute dtype."""
    if not isinstance(plan, ModelPlan) or plan.head is None:
        raise InvalidConfigError("plan.draft is not a plan for a draft head (plan.draft.head is null)")
    cfg = head.cfg  # type: ignore[attr-defined]
    if cfg.kind != plan.head:
        raise InvalidConfigError(f"plan.draft.head={plan.head!r} but the head is a {cfg.kind!r} head")
    for key, want in plan.model.items():
        if getattr(cfg, key, None) != want:
            raise InvalidConfigError(
                f"plan.draft.model.{key}={want!r} but the head has {getattr(cfg, key, None)!r}: "
                "the plan was made for another head"
            )
    fam = plan.families["ffn"]
    device = next(head.parameters()).device
    swapped: list[str] = []
    if fam.storage == "fp8_e4m3":
        require_kernel("fp8", fam.kernel, device)
        with torch.no_grad():
            for name in fam.scaling.get("modules", []):
                parent_name, _, leaf = name.rpartition(".")
                parent = head.get_submodule(parent_name) if parent_name else head
                lin = getattr(parent, leaf, None)
                if not isinstance(lin, nn.Linear):
                    raise InvalidConfigError(
                        f"plan.draft.families.ffn.scaling.modules: {name!r} is no Linear of the head"
                    )
                setattr(parent, leaf, FP8Linear.from_float(lin, kernel=fam.kernel))
                swapped.append(name)
    elif fam.quantized:
        raise InvalidConfigError(
            f"plan.draft.families.ffn.storage={fam.storage!r} is invalid for a head: allowed fp8_e4m3 or dense"
        )
    head.to(_DTYPES[plan.compute_dtype])
    log.info("applied the draft plan to the %s head: %s", plan.head, ", ".join(swapped) or "nothing quantized")
    return swapped
