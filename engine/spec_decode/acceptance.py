"""Step 4 of a round (engine/spec_decode/loop.py): every row's drafts accepted or rejected on the device, chains
or trees, greedy or sampled, and the round's one host sync that reads the verdict.

The rules themselves are pure functions with their own tests: chains in engine/spec_decode/rejection.py, trees
in engine/spec_decode/tree_accept.py. This picks the rule for the round and reads the result: the accepted
tokens, the rows whose scored logits are not finite, the feature that scored each row's new last token, the
logprobs asked for and, for trees, each row's accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.spec_decode.drafter import FeatureNeed
from engine.spec_decode.proposal import Proposal
from engine.spec_decode.randomness import PositionNoise, RoundNoise
from engine.spec_decode.rejection import greedy_accept, rejection_sample
from engine.spec_decode.sampling import RowProcessing, inverse_cdf
from engine.spec_decode.seq import TokenLogprob, token_logprobs
from engine.spec_decode.tree import depths, first_branch
from engine.spec_decode.tree_accept import tree_greedy_accept, tree_rejection_sample
from engine.spec_decode.verify import Scores


@dataclass
class Verdict:
    """Step 4's result, on the host."""

    tokens: list[list[int]]  # per row: the accepted drafts and the new token
    bad: list[bool]  # non-finite scored logits
    logprobs: dict[int, list[TokenLogprob]]  # rows that asked for them
    last_features: Tensor | None  # [B, H] the feature that scored each row's new last token
    cols: Tensor  # [B, K+1] the scored column of each committed token (a tree: its path's nodes + 1)
    paths: list[list[int]] | None = None  # trees: each row's accepted nodes by depth (None: chains)
    firsts: list[tuple[int, int]] | None = None  # trees: per row (its first branch's length, accepted along it)

    def row_features(self, b: int, a: int, need: FeatureNeed, scores: Scores) -> Tensor | None:
        """The target's features row b's drafter reads (``need``) after accepting ``a`` drafts."""
        if need is FeatureNeed.LAST:
            return None if self.last_features is None else self.last_features[b]
        if need is FeatureNeed.ALL and scores.features is not None:  # positions tlen .. the new tlen - 1
            new = scores.features[b, self.cols[b, : a + 1]]
            if scores.catch[b] > 1:  # a prefill: the features of the prompt's columns before the last
                assert scores.prefix is not None
                new = torch.cat([scores.prefix[b, : scores.catch[b] - 1], new])
            return new
        return None


def accept_round(
    proposal: Proposal,
    scores: Scores,
    processing: RowProcessing,
    noise: PositionNoise | RoundNoise | None,
    vocab: int,
    logprob_rows: dict[int, int],
) -> Verdict:
    """The round's verdict: ``processing`` the rows' sampling controls (greedy: one-hot distributions),
    ``noise`` the round's draws (None when every row is greedy), ``logprob_rows`` row -> top logprobs asked.

    With ``PositionNoise`` (drafts of fixed tokens) the rule is the greedy one with the target's sample at each
    scored position in place of its argmax: the inverse CDF of q there at the position's uniform (after a tree's
    node at depth j: uniform j, after the root: uniform 0). A draft is accepted with probability q(d), a tree's
    sibling tokens with their sum, and the new token at the first mismatch is q's sample given it is not the
    draft: the residual of the exact rule for one-hot drafts. Every committed token is the one plain sampling
    commits with that uniform."""
    logits = scores.logits[..., :vocab]  # [B, K+1, V]
    dev, B = logits.device, logits.shape[0]
    num_draft = torch.tensor(proposal.row_counts(), dtype=torch.long, device=dev)  # [B]
    scored = torch.arange(proposal.width + 1, device=dev) <= num_draft[:, None]  # [B, K+1] positions that count
    bad = ((~torch.isfinite(logits)).any(-1) & scored).any(-1)  # [B] non-finite rows
    tree, K = proposal.parents, proposal.width
    cols = torch.arange(K + 1, device=dev).expand(B, K + 1)  # [B, K+1] a chain's columns
    if processing.mode == "greedy" or isinstance(noise, PositionNoise):
        # greedy: accept while d == argmax q, else take argmax q; position noise: the same with the target's sample
        if isinstance(noise, PositionNoise):
            assert proposal.probs is None, "position noise takes drafts of fixed tokens (Drafter.samples False)"
            target = _position_samples(processing.probs_at(logits, proposal.tokens, 0), noise.cut(K), tree)
        else:
            target = processing.greedy_at(logits, proposal.tokens)  # [B, K+1] (within a grammar's mask)
        if tree is None:
            out, nacc = greedy_accept(proposal.tokens, target, num_draft)
        else:
            out, nacc, cols = tree_greedy_accept(proposal.tokens, tree, num_draft, target)
    else:
        assert isinstance(noise, RoundNoise)
        drawn = noise.cut(K)
        q = processing.probs_at(logits, proposal.tokens, 0)  # [B, K+1, V], penalties per draft position
        if tree is None:
            out, nacc = rejection_sample(proposal.tokens, proposal.probs, q, num_draft, drawn.uniforms, drawn.final)
        else:
            args = (proposal.probs, q, num_draft, drawn.uniforms, drawn.final)
            out, nacc, cols = tree_rejection_sample(proposal.tokens, tree, *args)
    rows = torch.arange(B, device=dev)
    last = None if scores.features is None else scores.features[rows, cols[rows, nacc]]  # [B, H]
    parts = [out, nacc[:, None], bad[:, None].to(out.dtype)]
    if tree is not None:  # the accepted path's columns; the first branch: its length, the path's nodes on it
        fb = first_branch(tree, num_draft)  # [B, K]
        on_path = torch.arange(K, device=dev)[None] < nacc[:, None]  # [B, K] path positions
        along = (fb.gather(1, (cols[:, 1:] - 1).clamp(min=0)) & on_path).sum(1)  # [B]
        parts += [cols, fb.sum(1, keepdim=True), along[:, None]]
    res = torch.cat(parts, 1).tolist()  # the one host sync
    paths = None if tree is None else [[c - 1 for c in r[K + 3 : K + 3 + r[K + 1] + 1][1:]] for r in res]
    firsts = None if tree is None else [(r[-2], r[-1]) for r in res]
    lps = {}
    if logprob_rows:
        lps = token_logprobs(logits.gather(1, cols[..., None].expand(-1, -1, vocab)), out, logprob_rows)
    return Verdict([r[: r[K + 1] + 1] for r in res], [bool(r[K + 2]) for r in res], lps, last, cols, paths, firsts)


def _position_samples(q: Tensor, noise: PositionNoise, parents: Tensor | None) -> Tensor:
    """[B, K+1] the target's sample at each scored column of q [B, K+1, V]: column 0 and a chain's column j at
    uniform j, a tree's node n (column n + 1) at the uniform of its children's depth."""
    B, P, V = q.shape
    u = noise.uniforms  # [B, K+1]
    if parents is not None:
        u = torch.cat([u[:, :1], u.gather(1, depths(parents))], 1)  # [B, N+1]
    return inverse_cdf(q.reshape(B * P, V), u.reshape(B * P)).view(B, P)
