"""The exact speculative acceptance rule (lossless speculative sampling).

For row b with K_b drafts d_0..d_{K_b-1}, draft distributions p_i and target
distributions q_i (both after the same temperature / top-k / top-p processing):

* accept d_i while u_i * p_i(d_i) < q_i(d_i), i.e. with probability
  min(1, q_i(d_i) / p_i(d_i)); p(d) = 0 < q(d) accepts, q(d) = 0 always rejects;
* at the first rejection j, sample from norm(max(0, q_j - p_j)) (from q_j when
  that residual is all zero through rounding);
* when all K_b drafts are accepted, sample the bonus token from q_{K_b}.

The emitted tokens are then distributed exactly as the target would sample
them. Greedy rows need no special case: with one-hot q and p the rule becomes
"accept while d_i == argmax q_i, replace the first mismatch by argmax q_i" (``greedy_accept``
does exactly that without building distributions, for all-greedy batches).

Everything runs on the tensors' device with no host synchronisation; the
randomness (uniforms and Exp(1) noise) is drawn up front by the caller.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.spec_decode.sampling import sample_from_probs


def acceptance(
    draft_tokens: Tensor,  # [B, K] int64 proposed ids (entries beyond num_draft[b] are ignored)
    draft_probs: Tensor | None,  # [B, K, V] float32 draft distributions; None = one-hot(d)
    target_probs: Tensor,  # [B, K+1, V] float32 target distributions, last = bonus position
    num_draft: Tensor,  # [B] int64 drafts per row, <= K
    uniforms: Tensor,  # [B, K] float32 in [0, 1)
) -> tuple[Tensor, Tensor, Tensor]:
    """The deterministic half of ``rejection_sample``.

    Returns accept [B, K] bool (per-position test, False beyond num_draft),
    num_accepted [B] int64, and the unnormalised distribution [B, V] float32 the
    next token is sampled from (residual at the first rejection, or the bonus
    distribution q_{K_b} when everything was accepted).
    """
    bsz, k = draft_tokens.shape
    pos = torch.arange(k, device=draft_tokens.device)  # [K]
    valid = pos.unsqueeze(0) < num_draft.unsqueeze(-1)  # [B, K]
    safe_tokens = torch.where(valid, draft_tokens, torch.zeros_like(draft_tokens))  # [B, K]
    idx = safe_tokens.unsqueeze(-1)  # [B, K, 1]

    q_d = target_probs[:, :k].gather(-1, idx).squeeze(-1)  # [B, K]
    if draft_probs is None:
        p_d = torch.ones_like(q_d)  # [B, K]
    else:
        p_d = draft_probs.gather(-1, idx).squeeze(-1)  # [B, K]
    accept = (uniforms * p_d < q_d) & valid  # [B, K]
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [B]

    rows = torch.arange(bsz, device=draft_tokens.device)  # [B]
    q_j = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < num_draft  # [B]
    j = num_accepted.clamp(max=max(k - 1, 0))  # [B] position of the draft that was rejected
    if k == 0:
        p_j = torch.zeros_like(q_j)  # [B, V]
    elif draft_probs is None:
        p_j = torch.zeros_like(q_j).scatter_(-1, safe_tokens[rows, j].unsqueeze(-1), 1.0)  # [B, V]
    else:
        p_j = draft_probs[rows, j]  # [B, V]
    residual = (q_j - p_j).clamp_min(0.0)  # [B, V]
    residual = torch.where((residual.sum(dim=-1) > 0).unsqueeze(-1), residual, q_j)
    dist = torch.where(rejected.unsqueeze(-1), residual, q_j)  # [B, V]
    return accept, num_accepted, dist


def rejection_sample(
    draft_tokens: Tensor,  # [B, K] int64 proposed ids (entries beyond num_draft[b] are ignored)
    draft_probs: Tensor
    | None,  # [B, K, V] float32, draft distribution after the same processing; None: deterministic (p = one-hot(d))
    target_probs: Tensor,  # [B, K+1, V] float32, target distribution at each draft position + the bonus position
    num_draft: Tensor,  # [B] int64, K_b <= K drafts of row b (ragged K)
    uniforms: Tensor,  # [B, K] float32 in [0, 1), drawn up front
    noise: Tensor,  # [B, V] float32 Exp(1), drawn up front, for the one residual/bonus sample per row
) -> tuple[Tensor, Tensor]:  # tokens [B, K+1] int64, num_accepted [B] int64
    """Verify K drafts per row against the target; see the module docstring.

    tokens[b, :n] are the accepted drafts, tokens[b, n] the new sample, with
    n = num_accepted[b]; entries after n are 0.
    """
    bsz, k = draft_tokens.shape
    _, num_accepted, dist = acceptance(draft_tokens, draft_probs, target_probs, num_draft, uniforms)
    new_token = sample_from_probs(dist, noise)  # [B]
    pos = torch.arange(k + 1, device=draft_tokens.device)  # [K+1]
    padded = torch.cat([draft_tokens, draft_tokens.new_zeros(bsz, 1)], dim=-1)  # [B, K+1]
    keep = pos.unsqueeze(0) < num_accepted.unsqueeze(-1)  # [B, K+1]
    tokens = torch.where(keep, padded, torch.zeros_like(padded))  # [B, K+1]
    tokens = tokens.scatter(-1, num_accepted.unsqueeze(-1), new_token.unsqueeze(-1))
    return tokens, num_accepted


def greedy_accept(
    draft_tokens: Tensor,  # [B, K] int64 proposed ids (entries beyond num_draft[b] are ignored)
    target_argmax: Tensor,  # [B, K+1] int64 argmax of the raw target logits at each scored position
    num_draft: Tensor,  # [B] int64, K_b <= K drafts of row b
) -> tuple[Tensor, Tensor]:  # tokens [B, K+1] int64, num_accepted [B] int64
    """``rejection_sample`` for a batch whose rows are all greedy, without building distributions:
    with one-hot p and q the rule is "accept while d_i == argmax q_i; the first mismatch (or the bonus
    position) takes argmax q". Same outputs, entries after n are 0."""
    bsz, k = draft_tokens.shape
    pos = torch.arange(k + 1, device=draft_tokens.device)  # [K+1]
    match = (draft_tokens == target_argmax[:, :k]) & (pos[:k].unsqueeze(0) < num_draft.unsqueeze(-1))  # [B, K]
    num_accepted = match.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    tokens = torch.where(
        pos.unsqueeze(0) <= num_accepted.unsqueeze(-1), target_argmax, torch.zeros_like(target_argmax)
    )  # [B, K+1]: accepted drafts equal the argmax
    return tokens, num_accepted
