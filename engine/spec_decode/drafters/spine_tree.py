"""Draft trees for sampled rows: a sampled chain (the spine) with i.i.d. siblings.

The exact rule for sampled rows over trees (engine/spec_decode/tree_accept.py, SpecInfer's) needs each node's
children drawn i.i.d. from the draft distribution at that node, their number fixed before they are drawn; EAGLE-2's
tree keeps children by their own probability, which breaks that, so it stays for greedy rows. A drafter that
samples a chain d_1 .. d_D (d_i from p_i, its processed distribution after d_1 .. d_{i-1}) makes a tree of this kind
at no extra draft cost: at depth i, d_i and ``branches`` - 1 more independent draws from p_i, all children of
d_{i-1}; only d_i is expanded.

K nodes are laid out depth by depth: depth i holds nodes (i-1) w .. i w - 1 with d_i first (the last depth what
remains of K). A row cut to its K_b nodes keeps a tree of this kind, and its first branch is the chain (what rows
that read their drafts in order take). Node n draws with the round's noise vector n, so the spine's draws are the
vectors 0, w, 2w, .. (``spine_noise``). Siblings may repeat a token (independent draws): the rule tests each.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.spec_decode.proposal import Proposal
from engine.spec_decode.sampling import sample_from_probs


def spine_depth(k: int, branches: int) -> int:
    """D: the spine's drafts for K nodes of ``branches`` per depth."""
    return -(-k // branches)


def spine_noise(noise: Tensor, k: int, branches: int) -> Tensor:
    """[B, D, V] the noise vectors of the spine's nodes (node n = 0, w, 2w, ..) of the round's [B, >= K, V]."""
    return noise[:, :k:branches]


def spine_tree(spine: Proposal, noise: Tensor, k: int, branches: int) -> Proposal:
    """The tree of K nodes around a sampled chain ``spine`` (D = spine_depth(k, branches) drafts with their
    distributions, drawn with ``spine_noise``) and the round's noise [B, >= K, V]."""
    assert spine.probs is not None, "a sampled chain carries its distributions"
    w, dev = branches, spine.tokens.device
    node = torch.arange(k, device=dev)
    depth = node // w  # [K]
    probs = spine.probs[:, depth]  # [B, K, V] each node's distribution: its depth's
    tokens = sample_from_probs(probs, noise[:, :k])  # [B, K] one independent draw per node
    tokens = torch.where(node % w == 0, spine.tokens[:, depth], tokens)  # the spine's own (the same draws)
    parents = torch.where(depth > 0, (depth - 1) * w, -1).expand(tokens.shape[0], k)  # [B, K] the spine node above
    counts = None if spine.counts is None else [k if c else 0 for c in spine.counts]
    return Proposal(tokens, probs.contiguous(), counts, parents.contiguous())
