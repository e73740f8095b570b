"""The verify pass of a round: the target's forward over each row's uncached tokens plus its drafts.

One pass, its rows padded to the widest; rows of different widths (a prompt that prefills beside rows that
decode, prompts of different lengths) run as passes of their own (engine/spec_decode/width_groups.py), so a
40-token prompt does not make every decoding row compute 40 positions. The pass scores K+1 positions per row,
from the last committed token on, and returns the target's features when the drafter reads them (a prefill
round for a drafter of every position's features returns every column's).

On the CPU's step kernel a round with padding runs packed instead: only each row's real tokens (its uncached
committed tokens and its drafts), all rows' in one row of the batch, each token with its own cache row and position
(``packed``; ``CachedForward.packs``). A row that drafted nothing (a copy drafter without a match; the K tuner gives
rows their own K) costs one token, not K+1, and a prompt that joins runs in the same pass as the decoding rows, the
weights read once. The forward writes every token's keys before any token attends, so each token sees its
sequence's earlier tokens of the same call and is computed as in the padded pass; only the scored tokens reach the
LM head. The scores come back in the padded [B, K+1] layout, zeros at the columns past a row's drafts (which no
acceptance reads). PyTorch's layers and CUDA keep the padded passes (their attention gathers the cache per row of
the batch; graphs and flash-attention take fixed shapes). A round whose drafter reads every prompt position's
features (a row prefills) is not packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.core.forward import CachedForward, Features, ForwardCall, KVCache, TreeMask
from engine.spec_decode.drafter import FeatureNeed
from engine.spec_decode.proposal import Proposal
from engine.spec_decode.tree import tree_mask
from engine.spec_decode.width_groups import width_groups


@dataclass(frozen=True)
class VerifyBatch:
    """One round's verify inputs."""

    tokens: Tensor  # [B, T] catch-up tokens then drafts, padded
    pos: Tensor  # [B, T] their positions (padding: the scratch slot)
    idx: Tensor  # [B, K+1] the scored columns (a row whose prompt was copied, catch 0: column 0, re-scored)
    catch: list[int]  # uncached committed tokens per row
    ks: list[int]  # drafts per row
    tlens: list[int]  # cached tokens per row
    rows: Tensor | None  # [B] cache rows (None: 0..B-1)
    row_ids: list[int]  # the same as ints
    aligned: bool  # rows 0..B-1 at one length, no padding: slice writes
    features: FeatureNeed  # what the drafter reads
    tree: TreeMask | None = None  # a draft tree's slots and mask (pos: positions by depth); None: chains
    packed: bool = False  # run only the real tokens, in one row with a cache row per token (CPU, padding to drop)

    @property
    def width(self) -> int:
        """T: the padded token count."""
        return self.tokens.shape[1]


@dataclass(frozen=True)
class Scores:
    """The target's scores of the round."""

    logits: Tensor  # [B, K+1, V] at the scored columns
    features: Tensor | None  # [B, K+1, H] at the scored columns (a drafter that reads features)
    prefix: Tensor | None  # [B, T, H] every column's (FeatureNeed.ALL and a row that prefills), else None
    catch: list[int]  # uncached committed tokens per row (prefix's columns before the scored ones)


def verify_batch(
    tokens: list[list[int]], tlens: list[int], proposal: Proposal, rows: list[int], scratch: int, need: FeatureNeed
) -> VerifyBatch:
    """The verify inputs of rows with committed ``tokens`` (``tlens`` of them cached) and ``proposal``'s drafts
    (chains, or trees: engine/spec_decode/tree.py)."""
    dev = proposal.tokens.device
    B, kmax, ks = len(tokens), proposal.width, proposal.row_counts()
    catch = [len(t) - n for t, n in zip(tokens, tlens)]
    T = max(catch) + kmax
    toks = torch.zeros(B, T, dtype=torch.long)
    pos = torch.full((B, T), scratch, dtype=torch.long)
    for b, (t, n) in enumerate(zip(tokens, tlens)):
        toks[b, : catch[b]] = torch.tensor(t[n:], dtype=torch.long)
        pos[b, : catch[b] + ks[b]] = torch.arange(n, n + catch[b] + ks[b])
    toks, pos = toks.to(dev), pos.to(dev)
    catch_t = torch.tensor(catch, dtype=torch.long, device=dev)
    if kmax:
        toks.scatter_(1, catch_t[:, None] + torch.arange(kmax, device=dev), proposal.tokens)
    idx = ((catch_t - 1)[:, None] + torch.arange(kmax + 1, device=dev)).clamp_(min=0)  # [B, K+1]
    prefix_rows = rows == list(range(B))
    row_t = None if prefix_rows else torch.tensor(rows, device=dev)
    if proposal.parents is not None and kmax:
        kv_len = max(n + c + k for n, c, k in zip(tlens, catch, ks))
        tree = tree_mask(pos, catch, tlens, proposal.parents, ks, kv_len)  # (pos rewritten: depths)
        return VerifyBatch(toks, pos, idx, catch, ks, tlens, row_t, rows, False, need, tree)
    aligned = prefix_rows and len(set(tlens)) == 1 and all(c + k == T for c, k in zip(catch, ks))
    every = need is FeatureNeed.ALL and max(catch) > 1  # every prompt position's features: the padded passes
    packed = dev.type == "cpu" and min(catch) >= 1 and not every and sum(catch) + sum(ks) < B * T
    return VerifyBatch(toks, pos, idx, catch, ks, tlens, row_t, rows, aligned, need, packed=packed)


def verify(target: CachedForward, cache: KVCache, vb: VerifyBatch) -> Scores:
    """The target's scores [B, K+1, V] (and features [B, K+1, H] for a drafter that reads them; for one of every
    position's and a row that prefills, also every column's [B, T, H]): one pass (the real tokens only where
    ``packed`` and the target packs), or one per group of rows of similar width (a tree's rows: one pass)."""
    if vb.packed and target.packs(cache):
        return _packed_pass(target, cache, vb)
    kmax = vb.idx.shape[1] - 1
    groups = width_groups([max(1, c + kmax) for c in vb.catch]) if vb.tree is None else []  # (catch 0: re-scored)
    if len(groups) > 1:
        return _passes(target, cache, vb, groups)
    kv_len = max(n + c + k for n, c, k in zip(vb.tlens, vb.catch, vb.ks))
    every = vb.features is FeatureNeed.ALL and max(vb.catch) > 1  # a row prefills: the prompt's features too
    want = Features.ALL if every else Features.SCORED if vb.features is not FeatureNeed.NONE else Features.NONE
    start = vb.tlens[0] if vb.aligned else None
    out = target.run(ForwardCall(vb.tokens, vb.pos, cache, kv_len, vb.rows, vb.idx, None, start, want, vb.tree))
    if every:
        assert out.features is not None
        return Scores(out.logits, _at(out.features, vb.idx), out.features, vb.catch)
    return Scores(out.logits, out.features, None, vb.catch)


def _passes(target: CachedForward, cache: KVCache, vb: VerifyBatch, groups: list[list[int]]) -> Scores:
    """One pass per group of rows, each at its own width."""
    B, T, kmax, dev = len(vb.catch), vb.width, vb.idx.shape[1] - 1, vb.tokens.device
    logits: Tensor | None = None
    feats: Tensor | None = None
    prefix: Tensor | None = None
    for g in groups:
        t_g = max(vb.catch[b] for b in g) + kmax
        if t_g == 0:  # rows starting from a shared prefill, no drafts: their scores are the prefill's (the loop's)
            continue
        sel = torch.tensor(g, device=dev)
        kv_len = max(vb.tlens[b] + vb.catch[b] + vb.ks[b] for b in g)
        g_rows = torch.tensor([vb.row_ids[b] for b in g], device=dev)
        want = Features.NONE if vb.features is FeatureNeed.NONE else Features.SCORED
        want = Features.ALL if vb.features is FeatureNeed.ALL and t_g - kmax > 1 else want  # a prompt's features
        call = ForwardCall(vb.tokens[sel, :t_g], vb.pos[sel, :t_g], cache, kv_len, g_rows, vb.idx[sel], features=want)
        out = target.run(call)
        lg, ft = out.logits, out.features
        if want is Features.ALL:
            assert ft is not None
            prefix = ft.new_zeros(B, T, ft.shape[-1]) if prefix is None else prefix
            prefix[sel, :t_g] = ft
            ft = _at(ft, vb.idx[sel])
        if logits is None:
            logits = lg.new_zeros(B, *lg.shape[1:])
            feats = None if ft is None else ft.new_zeros(B, *ft.shape[1:])
        logits[sel] = lg
        if feats is not None:
            feats[sel] = ft
    assert logits is not None
    return Scores(logits, feats, prefix, vb.catch)


def _packed_pass(target: CachedForward, cache: KVCache, vb: VerifyBatch) -> Scores:
    """Every row's real tokens (its catch then its drafts) as one row of N tokens [1, N], each with its own cache row
    and position; the scored ones (a row's last committed token and its drafts) through the LM head."""
    dev, K1 = vb.tokens.device, vb.idx.shape[1]
    catch, ks = torch.tensor(vb.catch, device=dev), torch.tensor(vb.ks, device=dev)
    lens = catch + ks  # [B] real tokens per row
    real_tok = torch.arange(vb.width, device=dev) < lens[:, None]  # [B, T]
    rows = torch.tensor(vb.row_ids, device=dev)[:, None].expand_as(real_tok)[real_tok]  # [N]
    real = torch.arange(K1, device=dev) <= ks[:, None]  # [B, K+1] scored columns with a token
    b_of, j_of = real.nonzero(as_tuple=True)  # [J] each scored token's row and column
    at = (lens.cumsum(0) - lens)[b_of] + catch[b_of] - 1 + j_of  # [J] its index among the N
    kv_len = max(n + c + k for n, c, k in zip(vb.tlens, vb.catch, vb.ks))
    want = Features.NONE if vb.features is FeatureNeed.NONE else Features.SCORED
    toks, pos = vb.tokens[real_tok][None], vb.pos[real_tok][None]  # [1, N]
    out = target.run(ForwardCall(toks, pos, cache, kv_len, rows[None], at[None], features=want))
    return Scores(_unpack(out.logits, real, b_of, j_of), _unpack(out.features, real, b_of, j_of), None, vb.catch)


def _unpack(x: Tensor | None, real: Tensor, b_of: Tensor, j_of: Tensor) -> Tensor | None:
    """x [1, J, D] of the scored tokens -> [B, K+1, D], zeros where a row has no token."""
    if x is None:
        return None
    out = x.new_empty(*real.shape, x.shape[-1])
    out[~real] = 0
    out[b_of, j_of] = x[0]
    return out


def _at(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, T, H] at the columns idx [B, J] -> [B, J, H]."""
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))
