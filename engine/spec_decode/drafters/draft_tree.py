"""EAGLE-2's dynamic draft tree for a drafter with a KV cache of its own: a draft model, or a head with attention.

From the root's logits at each row's last committed token, depth by depth: the ``branches`` most probable nodes of
the newest layer (by path probability) run through the drafter together, as one tree-masked call: each at the
position of its depth and in a slot of its own after the committed ones (expansion e of the round: slot base + e),
seeing the committed slots, its expanded ancestors' slots and its own; each one's ``branches`` most probable tokens
become its children. The ``budget`` most probable nodes of all are kept (``head_tree.keep_best``: ancestors first).
Greedy rows only: sampled rows draft chains or spine trees. The slots the tree wrote are not kept: the drafter's
next catch-up writes the committed entries over them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from engine.core.forward import CachedForward, ForwardCall, KVCache, TreeMask
from engine.spec_decode.drafters.head_tree import keep_best

# one tree-masked call over the nodes of the newest layer it expands:
# (pick [B, wp] their indices in the layer, tokens [B, wp], positions [B, wp], kv_len, tree) -> logits [B, wp, V]
Expand = Callable[[Tensor, Tensor, Tensor, int, TreeMask], Tensor]


def model_tree(
    model: CachedForward,
    cache: KVCache,
    rows: Tensor | None,
    root: Tensor,
    n_tok: list[int],
    budget: int,
    branches: int,
) -> tuple[Tensor, Tensor]:
    """A draft model's trees of ``budget`` nodes from root logits [B, V] (the common vocabulary) for rows of
    ``n_tok`` committed tokens, all in the draft cache: (tokens [B, budget], parents [B, budget]), topological
    order."""
    V = root.shape[1]

    def expand(pick: Tensor, tokens: Tensor, pos: Tensor, kv_len: int, tree: TreeMask) -> Tensor:
        return model.run(ForwardCall(tokens, pos, cache, kv_len, rows, tree=tree)).logits[..., :V]

    return masked_tree(expand, root, torch.tensor(n_tok, device=root.device), budget, branches)


def masked_tree(expand: Expand, root: Tensor, base: Tensor, budget: int, branches: int) -> tuple[Tensor, Tensor]:
    """Trees of ``budget`` nodes from root logits [B, V] whose depth-1 nodes go at position and slot ``base`` [B]
    (each row's first free slot): (tokens [B, budget] as indices of the logits, parents [B, budget]), topological
    order."""
    B, w, dev = root.shape[0], branches, root.device
    lp, ids = root.float().log_softmax(-1).topk(w, dim=-1)  # [B, w] the root's children
    toks, parents, scores = [ids], [torch.full((B, w), -1, dtype=torch.long, device=dev)], [lp]
    layers = max(0, budget // w)  # expansions: each writes at most w slots, never more than the budget
    E = layers * w
    anc = [torch.zeros(B, w, max(E, 1), dtype=torch.bool, device=dev)]  # nodes' expanded ancestors (by expansion)
    r = torch.arange(B, device=dev)[:, None]
    top = int(base.max())  # (one host read for the round)
    n_prev = 0
    for layer in range(layers):
        sc, tk, an = scores[-1], toks[-1], anc[-1]
        pick = sc.topk(min(w, sc.shape[1]), dim=-1).indices  # [B, wp] the layer's most probable nodes
        wp = pick.shape[1]
        e = layer * w + torch.arange(wp, device=dev)  # [wp] their expansion indices
        own = an[r, pick].clone()  # [B, wp, E]
        own[:, torch.arange(wp, device=dev), e] = True
        kv_len = top + layer * w + wp
        j = torch.arange(kv_len, device=dev)
        rel = j[None] - base[:, None]  # [B, kv] expansion index a slot holds (< 0: committed; >= E: another row's)
        ours = (rel >= 0) & (rel < E)
        seen = own.gather(2, rel.clamp(0, E - 1)[:, None].expand(B, wp, kv_len)) & ours[:, None]
        mask = (rel < 0)[:, None] | seen  # [B, wp, kv]
        pos = (base + layer)[:, None].expand(B, wp)  # depth layer + 1
        logits = expand(pick, tk[r, pick], pos, kv_len, TreeMask(base[:, None] + e[None], mask[:, None]))
        clp, cid = logits.float().log_softmax(-1).topk(w, dim=-1)  # [B, wp, w]
        scores.append((sc[r, pick][..., None] + clp - 1e-6).reshape(B, -1))  # a child ranks below its parent
        toks.append(cid.reshape(B, -1))
        parents.append((n_prev + pick)[..., None].expand(B, wp, w).reshape(B, -1))
        anc.append(own[:, :, None].expand(B, wp, w, own.shape[-1]).reshape(B, wp * w, -1))
        n_prev += sc.shape[1]
    out, par, _ = keep_best(torch.cat(toks, 1), torch.cat(parents, 1), torch.cat(scores, 1), budget, None)
    return out, par
