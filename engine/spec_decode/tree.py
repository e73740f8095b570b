"""A draft tree in the verify pass: positions by depth, one cache slot per node, the tree attention mask.

Row b's uncached committed tokens (``catch_b``) sit at slots = positions ``tlen_b ..``; its N_b nodes follow at
slots ``base_b + n`` (``base_b = tlen_b + catch_b``, node order) but at positions ``base_b - 1 + depth(n)``, so
siblings share a position and each node's rotary phase is that of the token it would be in its own chain.
A query sees every committed slot (``< base_b``, causally for the catch-up tokens) and, among the node slots,
only its ancestors and itself: no node sees a sibling's branch. After acceptance the accepted path's keys and
values are moved to slots ``base_b .. base_b + a - 1`` (``KVCache.move``), where a chain's already are.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.core.forward import TreeMask


def ancestors(parents: Tensor) -> Tensor:
    """parents [B, N] (-1: a child of the root; topological order) -> [B, N, N] bool: m is n or an ancestor of n."""
    B, N = parents.shape
    rows = torch.arange(B, device=parents.device)
    anc = torch.eye(N, dtype=torch.bool, device=parents.device).repeat(B, 1, 1)  # [B, N, N]
    for n in range(N):  # a parent's row is complete before its children's
        p = parents[:, n]  # [B]
        anc[:, n] |= anc[rows, p.clamp(min=0)] & (p >= 0)[:, None]
    return anc


def first_branch(parents: Tensor, counts: Tensor) -> Tensor:
    """[B, N] bool: the row's first branch, from the root each node's first child in node order (a chain drafter's
    path: EAGLE-2's top-1 path, a spine tree's spine), among its ``counts`` [B] nodes."""
    B, N = parents.shape
    rows, node = torch.arange(B, device=parents.device), torch.arange(N, device=parents.device)
    same = (parents[:, :, None] == parents[:, None, :]) & (node[None, :] < node[:, None])[None]  # [B, n, m]: m < n
    first_child = ~same.any(-1) & (node[None] < counts[:, None])  # [B, N] no earlier sibling
    on = torch.zeros(B, N, dtype=torch.bool, device=parents.device)
    for n in range(N):  # a parent's flag is set before its children's
        p = parents[:, n]
        on[:, n] = first_child[:, n] & torch.where(p >= 0, on[rows, p.clamp(min=0)], True)
    return on


def depths(parents: Tensor) -> Tensor:
    """[B, N] int64 depth of each node (1: a child of the root)."""
    return ancestors(parents).sum(-1)


def tree_mask(
    tokens_pos: Tensor, catch: list[int], tlens: list[int], parents: Tensor, counts: list[int], kv_len: int
) -> TreeMask:
    """The verify call's slots and mask for rows of ``catch`` uncached tokens then a tree of ``counts`` nodes.

    tokens_pos [B, T]: the chain layout's positions (catch-up tokens at their slots, padding at the scratch slot);
    node n of row b is at column catch_b + n. Returns the tree's slots [B, T], its mask [B, 1, T, kv_len] and
    rewrites ``tokens_pos`` at the node columns to the depth-based positions.
    """
    dev = parents.device
    B, N = parents.shape
    T = tokens_pos.shape[1]
    anc = ancestors(parents)  # [B, N, N]
    depth = anc.sum(-1)  # [B, N]
    catch_t = torch.tensor(catch, device=dev)
    base = torch.tensor(tlens, device=dev) + catch_t  # [B] the first node slot
    node = torch.arange(N, device=dev)
    real = node[None] < torch.tensor(counts, device=dev)[:, None]  # [B, N]
    cols = (catch_t[:, None] + node[None]).clamp(max=T - 1)  # [B, N] node columns
    slots = tokens_pos.clone()
    slots.scatter_(1, cols, torch.where(real, base[:, None] + node[None], slots.gather(1, cols)))
    tokens_pos.scatter_(1, cols, torch.where(real, base[:, None] - 1 + depth, tokens_pos.gather(1, cols)))
    j = torch.arange(kv_len, device=dev)
    causal = j[None, None] <= slots[..., None]  # [B, T, kv]: by slot (the catch-up tokens' rule)
    in_nodes = (j[None] >= base[:, None]) & (j[None] < base[:, None] + N)  # [B, kv] node slots
    anc_cols = torch.zeros(B, T, N, dtype=torch.bool, device=dev)  # node columns' ancestor rows
    anc_cols.scatter_(1, cols[..., None].expand(B, N, N), anc & real[..., None])
    m = (j[None] - base[:, None]).clamp(0, N - 1)  # [B, kv] the node a slot holds
    allowed = anc_cols.gather(2, m[:, None].expand(B, T, kv_len)) & in_nodes[:, None]  # [B, T, kv]
    mask = (causal & ~in_nodes[:, None]) | allowed
    return TreeMask(slots, mask[:, None])
