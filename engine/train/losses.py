"""The training losses of the train-draft tool (engine/train/distill.py): the draft's distribution against the
target's soft labels (KL over its top-k + one bucket for the rest, mixed with the hard next-token label), per
kind: a draft model on whole sequences; Medusa heads and the EAGLE head on random windows of the target's
features (EAGLE unrolled ``depth`` steps on its own features, with a regression of each on the target's);
the EAGLE head with attention on whole sequences at every depth at once (``EagleAttnHead.unrolled``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.spec_decode.heads.eagle3 import Eagle3Head
from engine.spec_decode.heads.eagle_attn import EagleAttnHead
from engine.spec_decode.heads.modules import draft_features
from engine.train.data import DistillData


class LossOptions(Protocol):
    """What the losses read (engine/train/distill.py's TrainOptions has it)."""

    heads: int
    positions: int
    hard_weight: float
    reg_weight: float


def kl_loss(logq: Tensor, vals: Tensor, idx: Tensor, pos_of: Tensor | None) -> Tensor:
    """KL(target || draft) per row over the target's top-k + one bucket for the rest.

    logq [R, V'] draft log-probs over its vocabulary; vals, idx [R, k] the target's top-k log-probs and
    full-vocabulary ids; pos_of [V] the draft-vocabulary index of each id (-1: not in it; None: identity)."""
    t_lp = vals.float()
    pos = idx.long() if pos_of is None else pos_of[idx.long()]
    inside = pos >= 0
    d_lp = logq.gather(-1, pos.clamp_min(0))
    t_p = t_lp.exp() * inside
    t_rest = (1 - t_p.sum(-1)).clamp_min(0)
    d_rest = torch.log1p(-(d_lp.exp() * inside).sum(-1).clamp_max(1 - 1e-6))
    return (t_p * (t_lp - d_lp)).sum(-1) + torch.xlogy(t_rest, t_rest) - t_rest * d_rest


def _hard(logq: Tensor, nxt: Tensor, pos_of: Tensor | None) -> Tensor:
    pos = nxt if pos_of is None else pos_of[nxt]
    keep = pos >= 0
    return -(logq.gather(-1, pos.clamp_min(0)[:, None])[:, 0] * keep).sum() / keep.sum().clamp_min(1)


def frequent_tokens(data: DistillData, n: int, vocab_size: int) -> Tensor:
    """The ``n`` most frequent ids of the data's text (sorted ascending)."""
    dev = data.tokens.device
    counts = torch.zeros(vocab_size, dtype=torch.long, device=dev)
    mask = torch.arange(data.tokens.shape[1], device=dev)[None] < data.lengths[:, None]
    counts.index_add_(0, data.tokens[mask], torch.ones(int(mask.sum()), dtype=torch.long, device=dev))
    return counts.topk(min(n, vocab_size)).indices.sort().values


def _windows(data: DistillData, n: int, depth: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """n random (row, t) with t + depth < length - 1 (every step of the window has a next token)."""
    dev = data.lengths.device
    ok = torch.arange(data.tokens.shape[1], device=dev)[None] + depth < data.lengths[:, None] - 1
    flat = ok.flatten().nonzero()[:, 0]
    pick = flat[torch.randint(0, len(flat), (n,), generator=g).to(dev)]  # g: a CPU generator, on any device
    return pick // data.tokens.shape[1], pick % data.tokens.shape[1]


def head_loss(
    kind: str,
    head: nn.Module,
    target: Any,
    lm_w: Tensor,
    pos_of: Tensor | None,
    data: DistillData,
    opts: LossOptions,
    g: torch.Generator,
) -> Tensor:
    """One batch's loss for medusa (head i on h_t vs q_{t+1+i}), eagle (unrolled depth steps) or the EAGLE head with
    attention (``_attn_head_loss``)."""
    if isinstance(head, EagleAttnHead):
        return _attn_head_loss(head, target, lm_w, pos_of, data, opts, g)
    if isinstance(head, Eagle3Head):
        return eagle3_loss(head, target, pos_of, data, opts, g)
    depth = opts.heads
    rows, t = _windows(data, opts.positions, depth, g)
    steps = t[:, None] + torch.arange(depth + 1, device=t.device)  # [R, depth + 1]
    assert data.features is not None
    h = data.features[rows[:, None], steps].float()  # [R, depth + 1, H]
    total = torch.zeros((), device=h.device)
    emb = None
    if kind == "eagle":
        emb = target.embed_tokens(data.tokens[rows[:, None], steps[:, 1:]]).float()  # tokens t+1 .. t+depth
    f = draft_features(head, h[:, 0], emb, depth)  # [R, depth, H]
    if kind == "eagle":
        total = total + opts.reg_weight * F.smooth_l1_loss(f, h[:, 1:])
    for j in range(depth):
        q_pos = steps[:, j + 1]  # the position whose target distribution draft j + 1 is scored against
        total = total + 0.8**j * _draft_loss(f[:, j], lm_w, pos_of, data, rows, q_pos, opts.hard_weight)
    return total


def _draft_loss(
    f: Tensor, lm_w: Tensor, pos_of: Tensor | None, data: DistillData, rows: Tensor, q_pos: Tensor, hard_weight: float
) -> Tensor:
    """Drafts scored from features f [M, H] against the target at (rows, q_pos) [M]: its soft labels' KL mixed
    with the hard label (the token after q_pos)."""
    logq = F.linear(f, lm_w).float().log_softmax(-1)
    kl = kl_loss(logq, data.vals[rows, q_pos], data.idx[rows, q_pos], pos_of).mean()
    hard = _hard(logq, data.tokens[rows, q_pos + 1], pos_of)
    return (1 - hard_weight) * kl + hard_weight * hard


def model_loss(draft: nn.Module, data: DistillData, opts: LossOptions, g: torch.Generator) -> Tensor:
    """KL on whole sequences: positions // T rows per step."""
    T = data.tokens.shape[1]
    rows = torch.randint(0, len(data.tokens), (max(1, opts.positions // T),), generator=g).to(data.tokens.device)
    x = data.tokens[rows]
    logq = draft(x).float().log_softmax(-1)
    valid = data.valid()[rows]
    kl = kl_loss(logq[valid], data.vals[rows][valid], data.idx[rows][valid], None).mean()
    hard = F.nll_loss(logq[valid], x[:, 1:][valid[:, :-1]]) if T > 1 else kl * 0
    return (1 - opts.hard_weight) * kl + opts.hard_weight * hard


def _attn_head_loss(
    head: EagleAttnHead,
    target: Any,
    lm_w: Tensor,
    pos_of: Tensor | None,
    data: DistillData,
    opts: LossOptions,
    g: torch.Generator,
) -> Tensor:
    """One batch's loss for the EAGLE head with attention: ``positions // T`` whole sequences (at least one),
    every depth j < ``heads`` at once: g[:, j, p] (the round rooted at p - j) is scored against the target's
    distribution at p + 1 and regressed on its feature there."""
    assert data.features is not None
    N, T = data.tokens.shape
    depth = opts.heads
    rows = torch.randint(0, N, (max(1, opts.positions // T),), generator=g).to(data.tokens.device)
    tok, n = data.tokens[rows], data.lengths[rows]
    f = data.features[rows, : T - 1].float()  # [R, T-1, H] positions 0..T-2
    e = target.embed_tokens(tok[:, 1:]).float()  # the tokens at 1..T-1
    out = head.unrolled(f, e, depth)  # [R, depth, T-1, H]
    p = torch.arange(T - 1, device=n.device)
    total = torch.zeros((), device=n.device)
    for j in range(depth):
        ok = (p[None] >= j) & (p[None] + 2 < n[:, None])  # a root, and a token after the scored position
        if not ok.any():
            continue
        r, q = ok.nonzero(as_tuple=True)
        gj = out[r, j, q]  # [M, H]
        reg = F.smooth_l1_loss(gj, data.features[rows[r], q + 1].float())
        total = total + 0.8**j * (
            _draft_loss(gj, lm_w, pos_of, data, rows[r], q + 1, opts.hard_weight) + opts.reg_weight * reg
        )
    return total


def eagle3_loss(
    head: Eagle3Head, target: Any, pos_of: Tensor | None, data: DistillData, opts: LossOptions, g: torch.Generator
) -> Tensor:
    """One batch's loss for the EAGLE-3 head, training-time test: ``positions // T`` whole sequences (at least
    one) unrolled ``heads`` steps (``Eagle3Head.unrolled``: step j >= 1 reads the head's own outputs of step
    j - 1); out[:, j, p] is scored by the head's norm and LM head against the target's distribution at p + 1
    (its soft labels' KL mixed with the hard label), weighted 0.8**j; no feature regression (EAGLE-3 has none)."""
    assert data.features is not None
    N, T = data.tokens.shape
    rows = torch.randint(0, N, (max(1, opts.positions // T),), generator=g).to(data.tokens.device)
    tok, n = data.tokens[rows], data.lengths[rows]
    f = head.fuse(data.features[rows, : T - 1].float())  # [R, T-1, H] the fused features at 0..T-2
    e = target.embed_tokens(tok[:, 1:]).float() if head.embed_tokens is None else head.embed_tokens(tok[:, 1:])
    out = head.unrolled(f, e, opts.heads)  # [R, depth, T-1, H]
    p = torch.arange(T - 1, device=n.device)
    total = torch.zeros((), device=n.device)
    for j in range(opts.heads):
        ok = (p[None] >= j) & (p[None] + 2 < n[:, None])  # a root, and a token after the scored position
        if not ok.any():
            continue
        r, q = ok.nonzero(as_tuple=True)
        logq = head.logits(out[r, j, q]).float().log_softmax(-1)
        kl = kl_loss(logq, data.vals[rows[r], q + 1], data.idx[rows[r], q + 1], pos_of).mean()
        hard = _hard(logq, data.tokens[rows[r], q + 2], pos_of)
        total = total + 0.8**j * ((1 - opts.hard_weight) * kl + opts.hard_weight * hard)
    return total
