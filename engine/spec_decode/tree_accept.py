"""Exact acceptance over draft trees (a chain is the one-branch case and gets the chain rule's result).

Row b's nodes n = 0..N_b-1 carry tokens d_n, parents (-1: the root, the last committed token) and the draft
distribution p_n each was drawn from (one-hot at d_n for a deterministic drafter). Target distributions are
scored at the root (column 0) and at every node (column n + 1).

Sampled rows (recursive rejection sampling, SpecInfer / SpecTr): start at the root with r = q_root. Try the
current node's children in node order; child c is accepted when u_c * p_c(d_c) < r̂(d_c), with r̂ = r / sum(r);
a rejected child leaves r = max(0, r̂ - p_c). An accepted child becomes the current node and r = q_c. When
the current node's children are all rejected, the new token is drawn from r (from q at the node where r is
all zero through rounding); when the current node is a leaf, from q at it (the bonus token). With children
drawn i.i.d. from p (a model drafter) this is SpecInfer's rule; with distinct deterministic children
(p one-hot) a rejected child's token is removed from r and r renormalized: sampling without replacement.
Both keep the target's distribution exactly. One pass over the nodes in topological order visits each
child after its parent, so the walk is N vector steps on the device, with no host synchronisation.

Greedy rows: accept the child whose token is the target's argmax at its parent, down the tree; the new token is
the argmax at the deepest accepted node: the longest path matching plain greedy decoding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.spec_decode.sampling import sample_from_probs
from engine.spec_decode.tree import depths


def _path(parents: Tensor, best: Tensor, nacc: Tensor) -> Tensor:
    """[B, N] node at each accepted depth (-1 past nacc): walked up from ``best`` (the deepest accepted node)."""
    B, N = parents.shape
    rows = torch.arange(B, device=parents.device)
    path = torch.full((B, N), -1, dtype=torch.long, device=parents.device)  # [B, N]
    node = best.clone()  # [B]
    for i in range(N):  # depth nacc - 1 - i holds node, then its parent
        d = nacc - 1 - i  # [B]
        live = d >= 0
        path[rows[live], d[live]] = node[live]
        node = torch.where(live, parents[rows, node.clamp(min=0)], node)
    return path


def _result(tokens: Tensor, path: Tensor, nacc: Tensor, new: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(out [B, N+1]: the path's tokens then the new one, 0 after; nacc [B]; cols [B, N+1]: each output's
    scored column: 0 (the root) then 1 + the path's nodes, 0 after)."""
    B, N = tokens.shape
    pos = torch.arange(N + 1, device=tokens.device)
    on_path = path >= 0  # [B, N]
    toks = torch.where(on_path, tokens.gather(1, path.clamp(min=0)), torch.zeros_like(tokens))  # [B, N]
    out = torch.cat([toks, toks.new_zeros(B, 1)], 1).scatter(1, nacc[:, None], new[:, None])  # [B, N+1]
    cols = torch.cat([torch.zeros_like(nacc)[:, None], torch.where(on_path, path + 1, 0)], 1)  # [B, N+1]
    return torch.where(pos[None] <= nacc[:, None], out, 0), nacc, cols


def tree_greedy_accept(
    tokens: Tensor,  # [B, N] int64 node tokens
    parents: Tensor,  # [B, N] int64 parent node (-1: the root)
    num_draft: Tensor,  # [B] int64 nodes per row
    target_argmax: Tensor,  # [B, N+1] int64 argmax at the root (0) and at each node (n + 1)
) -> tuple[Tensor, Tensor, Tensor]:  # out [B, N+1], nacc [B], cols [B, N+1]
    B, N = tokens.shape
    rows = torch.arange(B, device=tokens.device)
    valid = torch.arange(N, device=tokens.device)[None] < num_draft[:, None]  # [B, N]
    want = target_argmax.gather(1, parents + 1)  # [B, N] the argmax at each node's parent
    ok = torch.zeros(B, N, dtype=torch.bool, device=tokens.device)  # [B, N] on a matching path
    for n in range(N):
        p = parents[:, n]
        up = torch.where(p >= 0, ok[rows, p.clamp(min=0)], True)
        ok[:, n] = valid[:, n] & up & (tokens[:, n] == want[:, n])
    score = torch.where(ok, depths(parents), 0)  # [B, N]
    nacc, best = score.max(-1)  # [B], [B]: the first deepest (one per depth: siblings are distinct)
    path = _path(parents, best, nacc)
    new = target_argmax.gather(1, torch.where(nacc > 0, best + 1, 0)[:, None])[:, 0]  # [B]
    return _result(tokens, path, nacc, new)


def tree_rejection_sample(
    tokens: Tensor,  # [B, N] int64 node tokens
    parents: Tensor,  # [B, N] int64 parent node (-1: the root)
    draft_probs: Tensor | None,  # [B, N, V] float32 distribution each node was drawn from; None: one-hot
    target_probs: Tensor,  # [B, N+1, V] float32 at the root (0) and at each node (n + 1)
    num_draft: Tensor,  # [B] int64 nodes per row
    uniforms: Tensor,  # [B, N] float32 in [0, 1), one per node
    noise: Tensor,  # [B, V] float32 Exp(1) for the one new token per row
) -> tuple[Tensor, Tensor, Tensor]:  # out [B, N+1], nacc [B], cols [B, N+1]
    B, N = tokens.shape
    dev = tokens.device
    rows = torch.arange(B, device=dev)
    cur = torch.full((B,), -1, dtype=torch.long, device=dev)  # [B] the current node (-1: the root)
    r = target_probs[:, 0].clone()  # [B, V] what the next child is tested against (unnormalised)
    rejected = torch.zeros(B, dtype=torch.bool, device=dev)  # [B] a child of the current node was rejected
    path = torch.full((B, N), -1, dtype=torch.long, device=dev)  # [B, N]
    nacc = torch.zeros(B, dtype=torch.long, device=dev)  # [B]
    for n in range(N):
        tok = tokens[:, n : n + 1]  # [B, 1]
        child = (parents[:, n] == cur) & (n < num_draft)  # [B]
        p = torch.zeros_like(r).scatter_(1, tok, 1.0) if draft_probs is None else draft_probs[:, n]  # [B, V]
        rn = r / r.sum(-1, keepdim=True).clamp_min(torch.finfo(r.dtype).tiny)  # [B, V] normalised
        acc = child & (uniforms[:, n] * p.gather(1, tok)[:, 0] < rn.gather(1, tok)[:, 0])  # [B]
        rej = child & ~acc
        r = torch.where(rej[:, None], (rn - p).clamp_min(0.0), r)
        rejected = (rejected | rej) & ~acc
        path[rows, nacc.clamp(max=N - 1)] = torch.where(acc, n, path[rows, nacc.clamp(max=N - 1)])
        nacc = nacc + acc.long()
        cur = torch.where(acc, n, cur)
        r = torch.where(acc[:, None], target_probs[:, n + 1], r)
    q_cur = target_probs[rows, cur + 1]  # [B, V]
    dist = torch.where(rejected[:, None] & (r.sum(-1, keepdim=True) > 0), r, q_cur)  # [B, V]
    return _result(tokens, path, nacc, sample_from_probs(dist, noise))
