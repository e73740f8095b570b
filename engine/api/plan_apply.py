"""Quantizing an engine's models as a PrecisionPlan says (module swap), with SmoothQuant calibration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from engine.core.errors import InvalidConfigError
from engine.core.model import Transformer
from engine.core.tokenizer import Tokenizer
from engine.kernels.backends import select_attention


def calib_batches(
    tok: Tokenizer, calib: str | Sequence[Sequence[int]], window: int = 256, max_windows: int = 16
) -> list[torch.Tensor]:
    """Calibration text (or token lists) -> up to max_windows LongTensors [1, <=window]."""
    if isinstance(calib, str):
        ids = tok.encode(calib)
        rows = [ids[i : i + window] for i in range(0, len(ids), window)]
    else:
        rows = [list(r) for r in calib]
    rows = [r for r in rows if r][:max_windows]
    if not rows:
        raise InvalidConfigError("calib is empty: SmoothQuant calibration needs at least one token")
    return [torch.tensor([r], dtype=torch.long) for r in rows]


def apply_precision_plan(
    plan: Any,
    target: Transformer,
    draft: Transformer | None,
    tok: Tokenizer,
    dev: torch.device,
    calib: str | Sequence[Sequence[int]] | None,
) -> None:
    """Quantize target and draft by module swap, as the PrecisionPlan says."""
    from quant.apply import apply_plan, collect_activation_stats
    from quant.plan_schema import PrecisionPlan

    if not isinstance(plan, PrecisionPlan):
        raise InvalidConfigError(
            f"plan={type(plan).__name__} is invalid: allowed a quant.plan_schema.PrecisionPlan or None"
        )
    if plan.device != dev.type:
        raise InvalidConfigError(
            f"plan.device={plan.device!r} but the engine runs on {dev.type!r}: make the plan with device={dev.type!r}"
        )
    attn = select_attention(plan.attention_backend, dev)
    for m in (target, draft):
        if m is not None:
            m.use_kernels(attention=attn, step=m.layer_step)
    stats = None
    if any(f.scaling.get("smoothquant_alpha") is not None for f in plan.target.all_plans() if f.quantized):
        if calib is None:
            raise InvalidConfigError(
                "calib is required: the plan smooths the INT8 FFN (SmoothQuant) and needs "
                "calibration text or token lists (never the eval text)"
            )
        stats = collect_activation_stats(target, calib_batches(tok, calib))
    if draft is not None and plan.draft is not None and plan.draft.head is not None:
        raise InvalidConfigError(
            f"plan.draft was made for a {plan.draft.head} head, but the draft is a model: "
            "make the plan with the draft model's config"
        )
    apply_plan(target, plan.target, stats)
    if draft is not None and plan.draft is not None:
        apply_plan(draft, plan.draft)


def apply_head_precision(plan: Any, head: nn.Module, kind: str) -> list[str]:
    """The plan's draft part applied to a trained head (``kind``: medusa | eagle): the Linears it turned FP8.
    A plan without a draft part leaves the head as loaded."""
    from quant.head_plan import apply_head_plan

    if plan.draft is None:
        return []
    if plan.draft.head is None:
        raise InvalidConfigError(
            f"plan.draft was made for a draft model, but the draft is a {kind} head: make the plan with "
            "the head's config (make_plan(..., draft_head=...))"
        )
    return apply_head_plan(head, plan.draft)
