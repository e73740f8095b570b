"""Draft trees around a drafter's sampled chain (the spine): i.i.d. siblings at each depth.

The exact rule for sampled rows over trees (engine/spec_decode/tree_accept.py, SpecInfer's) needs each node's
children drawn i.i.d. from the draft distribution at that node, their number fixed before they are drawn; EAGLE-2's
tree keeps children by their own probability, which breaks that, so it stays for greedy rows. A drafter that
samples a chain d_1 .. d_D (d_i from p_i, its processed distribution after d_1 .. d_{i-1}) makes a tree of this kind
at no extra draft cost: at depth i, d_i and ``branches`` - 1 more independent draws from p_i, all children of
d_{i-1}; only d_i is expanded.

K nodes are laid out depth by depth: depth i holds nodes (i-1) w .. i w - 1 with d_i first (the last depth what
remains of K), D = ceil(K / w). A row cut to its K_b nodes keeps a tree of this kind, and its first branch is the
spine. Node n draws with the round's noise vector n, so the spine's draws are the vectors 0, w, 2w, ..
(``spine_batch``). Siblings may repeat a token (independent draws): the rule tests each. A row that takes a chain
(``DraftBatch.chains``: it reads its drafts in order, or is greedy) drafts its K-draft chain with the vectors
0 .. K-1 as in a chain round; the spine then runs K steps for every row (the tree rows' later ones unused).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from engine.spec_decode.drafter import DraftBatch
from engine.spec_decode.proposal import Proposal
from engine.spec_decode.sampling import sample_from_probs


def spine_depth(k: int, branches: int) -> int:
    """D: the spine's drafts for K nodes of ``branches`` per depth."""
    return -(-k // branches)


def spine_trees(batch: DraftBatch, branches: int) -> bool:
    """Whether a drafter configured for ``branches`` drafts spine trees this round: a sampled batch, trees on."""
    return batch.processing.mode != "greedy" and batch.tree and branches > 1 and batch.noise is not None


def sampled_trees(batch: DraftBatch, branches: int, chain: Callable[[DraftBatch], Proposal]) -> Proposal:
    """The round's spine trees: ``chain`` (the drafter's sampled chain of ``b.k`` drafts with its distributions,
    drawn with ``b.noise``) run on ``spine_batch``, its siblings drawn by ``spine_tree``."""
    return spine_tree(chain(spine_batch(batch, branches)), batch, branches)


def _chain_rows(batch: DraftBatch) -> tuple[bool, Tensor]:
    """(whether any row drafts a chain, [B] bool those rows); the flag is read on the host."""
    rows = batch.chains if batch.chains is not None else [False] * len(batch.seqs)
    return any(rows), torch.tensor(rows, dtype=torch.bool, device=batch.device)


def spine_steps(batch: DraftBatch, branches: int) -> int:
    """The chain's steps for a spine tree of ``batch.k`` nodes: D, or K where a row takes a chain."""
    return batch.k if _chain_rows(batch)[0] else spine_depth(batch.k, branches)


def _layout(batch: DraftBatch, branches: int, dev: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(node [K], its depth [K], parents [B, K]: the spine node above, or the previous node for a chain row;
    the chain rows [B] bool, None where no row takes a chain)."""
    w, k = branches, batch.k
    node = torch.arange(k, device=dev)
    depth = node // w
    parents = torch.where(depth > 0, (depth - 1) * w, -1).expand(len(batch.seqs), k)
    some, chains = _chain_rows(batch)
    if not some:
        return node, depth, parents.contiguous(), None
    return node, depth, torch.where(chains[:, None], node - 1, parents).contiguous(), chains


def spine_batch(batch: DraftBatch, branches: int) -> DraftBatch:
    """The batch the drafter's chain is drawn for: D steps with each tree row's spine noise (vectors 0, w, 2w, ..),
    or K steps where a row takes a chain (its vectors 0 .. K-1)."""
    assert batch.noise is not None, "a sampled batch carries its noise"
    k, chains = batch.k, _chain_rows(batch)[1]
    steps = spine_steps(batch, branches)
    i = torch.arange(steps, device=batch.device)
    idx = torch.where(chains[:, None], i[None], (i * branches).clamp(max=k - 1)[None])  # [B, S] noise per step
    noise = batch.noise.gather(1, idx[..., None].expand(-1, -1, batch.noise.shape[-1]))
    return replace(batch, k=steps, noise=noise)


def spine_tree(spine: Proposal, batch: DraftBatch, branches: int) -> Proposal:
    """The rows' trees of K = batch.k nodes around their sampled chain ``spine`` (drawn for ``spine_batch``, with its
    distributions), chain rows' chains as drafted."""
    assert spine.probs is not None and batch.noise is not None, "a sampled chain carries its distributions"
    k = batch.k
    node, depth, parents, chains = _layout(batch, branches, spine.tokens.device)
    probs = spine.probs[:, depth]  # [B, K, V] each node's distribution: its depth's
    tokens = sample_from_probs(probs, batch.noise[:, :k])  # [B, K] one independent draw per node
    tokens = torch.where(node % branches == 0, spine.tokens[:, depth], tokens)  # the spine's own (the same draws)
    if chains is not None:  # the spine ran K steps: those rows keep it as their chain
        tokens = torch.where(chains[:, None], spine.tokens[:, :k], tokens)
        probs = torch.where(chains[:, None, None], spine.probs[:, :k], probs)
    counts = None if spine.counts is None else [k if c else 0 for c in spine.counts]
    return Proposal(tokens, probs.contiguous(), counts, parents)
