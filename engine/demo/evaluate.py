"""Evaluating the demo pair: held-out perplexity of target and draft and their top-1 agreement."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.core.errors import InvalidConfigError
from engine.core.model import Transformer


@torch.no_grad()
def evaluate_pair(target: Transformer, draft: Transformer, ids: torch.Tensor, ctx: int) -> dict[str, float]:
    """fp32 held-out perplexity of both and the draft's greedy top-1 agreement with the target.

    Non-overlapping windows of ``ctx`` tokens; the second half of each is scored (llama.cpp style).
    """
    n = len(ids) // ctx
    if n < 1:
        raise InvalidConfigError(f"eval_ctx={ctx} is invalid: allowed at most {len(ids)} (held-out tokens)")
    windows = ids[: n * ctx].view(n, ctx)
    nll = {"target": 0.0, "draft": 0.0}
    agree, count = 0, 0
    for w in windows.split(4):
        y = w[:, ctx // 2 + 1 :]
        preds = {}
        for name, m in (("target", target), ("draft", draft)):
            logits = m(w)[:, ctx // 2 : -1].float()
            nll[name] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            preds[name] = logits.argmax(-1)
        agree += (preds["target"] == preds["draft"]).sum().item()
        count += y.numel()
    return {
        "target_ppl": round(math.exp(nll["target"] / count), 4),
        "draft_ppl": round(math.exp(nll["draft"] / count), 4),
        "agreement": round(agree / count, 4),
        "positions": count,
    }
