"""Evaluating the demo pair: held-out perplexity of target and draft and their top-1 agreement."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.core.errors import InvalidConfigError
from engine.core.model import KVCache, Transformer


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


@torch.no_grad()
def greedy_agreement(
    target: Transformer,
    draft: Transformer,
    ids: torch.Tensor,
    n_prompts: int = 16,
    prompt_len: int = 64,
    new_tokens: int = 128,
) -> float:
    """Draft top-1 == target top-1 along the target's own greedy continuations of held-out prompts
    (the per-token acceptance of greedy speculative decoding)."""
    starts = torch.linspace(0, len(ids) - prompt_len - 1, n_prompts).long().tolist()
    seq = torch.stack([ids[s : s + prompt_len] for s in starts])
    cache = KVCache(target.config, n_prompts, prompt_len + new_tokens, torch.float32, "cpu")
    logits = target(seq, cache=cache, kv_len=prompt_len)[:, -1]
    for pos in range(prompt_len, prompt_len + new_tokens - 1):
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
        logits = target(seq[:, -1:], input_pos=torch.full((n_prompts, 1), pos), cache=cache, kv_len=pos + 1)[:, -1]
    seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    t_top = target(seq)[:, prompt_len - 1 : -1].argmax(-1)
    d_top = draft(seq)[:, prompt_len - 1 : -1].argmax(-1)
    return round((t_top == d_top).float().mean().item(), 4)
