"""EAGLE-2's dynamic draft tree for a head whose step maps (feature, token) to (next feature, logits).

Depth by depth, the ``branches`` most probable nodes of the newest layer (by path probability: the product of
the head's probabilities along the path) are expanded together in one batched head step, each into its
``branches`` most probable children. When the depth limit is reached, the ``budget`` most probable nodes of all
generated are kept (a child is never more probable than its parent, so the kept set holds every kept node's
ancestors) and laid out depth by depth. Greedy rows only: the children are the head's top tokens, which the
greedy acceptance takes as they are; sampled rows draft chains (their children would have to be drawn from p).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from engine.spec_decode.proposal import Proposal

Step = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]  # (features [M, H], tokens [M]) -> (features, logits)


def dynamic_tree(
    step: Step, f: Tensor, tok: Tensor, budget: int, branches: int, vocab_ids: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Rows' trees from root features f [B, H] and last tokens tok [B]: (tokens [B, budget], parents [B, budget],
    path log-probabilities [B, budget]) in topological order (depth, then probability)."""
    B, w = f.shape[0], branches
    depth_max = max(1, -(-budget // w) + 1)  # enough layers for the budget to go deep on a confident head
    f_out, logits = step(f, tok)  # the root's children
    lp, ids = logits.float().log_softmax(-1).topk(w, dim=-1)  # [B, w]
    toks, scores = [ids], [lp]
    parents = [torch.full((B, w), -1, dtype=torch.long, device=f.device)]
    feats = [f_out[:, None].expand(B, w, f.shape[1])]  # what each node's expansion feeds the head with
    n_prev = 0
    for _ in range(depth_max - 1):
        layer_scores, layer_toks, layer_feats = scores[-1], toks[-1], feats[-1]
        pick = layer_scores.topk(min(w, layer_scores.shape[1]), dim=-1).indices  # [B, w] nodes to expand
        rows = torch.arange(B, device=f.device)[:, None]
        fe = layer_feats[rows, pick].reshape(-1, f.shape[1])  # [B*w, H]
        te = _ids(layer_toks[rows, pick].reshape(-1), vocab_ids)
        f_next, lg = step(fe, te)
        clp, cid = lg.float().log_softmax(-1).topk(w, dim=-1)  # [B*w, w]
        clp = clp - 1e-6  # a child ranks strictly below its parent, also where the head is certain
        scores.append((layer_scores[rows, pick][..., None] + clp.view(B, -1, w)).reshape(B, -1))
        toks.append(cid.view(B, -1))
        parents.append((n_prev + pick)[..., None].expand(B, pick.shape[1], w).reshape(B, -1))
        H = f.shape[1]
        feats.append(f_next.view(B, -1, 1, H).expand(B, pick.shape[1], w, H).reshape(B, -1, H))
        n_prev += layer_scores.shape[1]
    return keep_best(torch.cat(toks, 1), torch.cat(parents, 1), torch.cat(scores, 1), budget, vocab_ids)


def _ids(t: Tensor, vocab_ids: Tensor | None) -> Tensor:
    return t if vocab_ids is None else vocab_ids[t]


def keep_best(
    toks: Tensor, parents: Tensor, scores: Tensor, budget: int, vocab_ids: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The ``budget`` most probable generated nodes per row, re-indexed in generation order (parents first)."""
    B, G = toks.shape
    n = min(budget, G)
    keep = scores.topk(n, dim=-1).indices.sort(-1).values  # [B, n] generation order: a parent before its children
    new_index = torch.full((B, G), -1, dtype=torch.long, device=toks.device)
    new_index.scatter_(1, keep, torch.arange(n, device=toks.device).expand(B, n))
    old_parent = parents.gather(1, keep)  # [B, n]
    par = torch.where(old_parent >= 0, new_index.gather(1, old_parent.clamp(min=0)), -1)
    return _ids(toks.gather(1, keep), vocab_ids), par, scores.gather(1, keep)


def tree_proposal(tokens: Tensor, parents: Tensor, have: list[bool]) -> Proposal:
    """The rows' trees as a Proposal (no tree for a row without a feature)."""
    counts = [tokens.shape[1] if h else 0 for h in have]
    return Proposal(tokens, None, counts, parents)
