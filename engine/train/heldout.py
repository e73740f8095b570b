"""How well a trained draft drafts: the engine's greedy rounds, simulated on held-out text.

The held-out sequences are continuations the target generated greedily from prompts that lie apart
from every training prompt and its continuation. From a position L where a round could start (its
first draft proposes the token at L), the draft proposes K tokens along the target's own greedy text:
while its drafts match, they are the tokens the round commits, so teacher forcing gives exactly the
engine's drafts. ``leading_matches`` counts the leading drafts equal to the generated tokens; a greedy
round at fixed K starting at L commits that many + 1. The first round starts where the engine's does
(a draft model drafts from the prompt's end, a head from the token after it: before the prefill
there is no feature), and each round moves L on by what it commits, until fewer than K tokens remain.
The mean accepted length and acceptance rate are those of the engine's greedy rounds at that K on this
text, but for each sequence's prefill and last, shorter rounds, which ``tools/bench.py``'s figures count
(its mean accepted length reads a little lower for them).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from engine.core.errors import InvalidConfigError
from engine.spec_decode.heads.eagle3 import Eagle3Head
from engine.spec_decode.heads.eagle_attn import EagleAttnHead
from engine.spec_decode.heads.modules import draft_features
from engine.spec_decode.registry import DRAFTERS
from engine.train.data import DistillData, generate, label, prompt_starts

log = logging.getLogger(__name__)

EVAL_KINDS = DRAFTERS.trainable()  # the kinds specmix-train-draft trains (engine/spec_decode/registry.py)


class DistillOptions(Protocol):
    """What the held-out prompts depend on (engine/train/distill.py's TrainOptions has it)."""

    kind: str
    samples: int
    prompt_len: int
    gen_len: int
    seed: int


def first_start(kind: str, prompt_len: int) -> int:
    """The position of the first round's first draft: the prompt's end for a draft model, one later for a head."""
    return prompt_len if kind == "model" else prompt_len + 1


@torch.no_grad()
def leading_matches(
    kind: str,
    draft: nn.Module,
    target: Any,
    row: int,
    data: DistillData,
    k: int,
    lm_w: Tensor | None,
    vocab_ids: Tensor | None,
) -> Tensor:
    """[S] int: for each start L = first .. length - k (``first_start``), how many of the k drafts of a round
    whose first draft is the token at L equal the generated tokens L, L + 1, ... before the first that does not.

    kind "model": ``draft`` is a draft model (teacher-forced on the row); "eagle" / "medusa": a head on
    the target's features ``data.features``, scored by ``lm_w`` [V', H] (rows ``vocab_ids`` [V'] of the
    target's LM head, or all of it when None)."""
    if kind not in EVAL_KINDS:
        raise InvalidConfigError(f"kind={kind!r} is invalid: allowed {', '.join(EVAL_KINDS)}")
    n = int(data.lengths[row])
    tokens = data.tokens[row, :n]  # [n]
    dev = tokens.device
    starts = torch.arange(first_start(kind, data.prompt_len), n - k + 1, device=dev)  # [S]
    at = starts[:, None] + torch.arange(k, device=dev)  # [S, k]: the positions of each round's drafts
    if kind == "model":
        got = draft(tokens[None])[0].argmax(-1)[at - 1]  # the draft's next token after each position
    elif isinstance(draft, Eagle3Head):  # every round at once, scored by its own norm and LM head
        assert data.features is not None
        e = target.embed_tokens(tokens[1:]) if draft.embed_tokens is None else draft.embed_tokens(tokens[1:])
        out = draft.unrolled(draft.fuse(data.features[row, : n - 1].float())[None], e.float()[None], k)
        got = draft.logits(out[0, torch.arange(k, device=dev)[None], at - 2]).argmax(-1)  # [S, k]
        if vocab_ids is not None:
            got = vocab_ids[got]
    else:
        if data.features is None or lm_w is None:
            raise InvalidConfigError(f"kind={kind!r}: a head needs the target's features and LM head rows")
        if isinstance(draft, EagleAttnHead):  # every round at once: draft j of the round rooted at L - 2
            out = draft.unrolled(
                data.features[row, : n - 1].float()[None], target.embed_tokens(tokens[1:]).float()[None], k
            )
            feats = out[0, torch.arange(k, device=dev)[None], at - 2]  # [S, k, H]
        else:
            f = data.features[row, starts - 2].float()  # [S, H]: the feature that scored the token at L - 1
            emb = target.embed_tokens(tokens[at - 1]).float() if kind == "eagle" else None  # the token before each
            feats = draft_features(draft, f, emb, k)
        got = (feats @ lm_w.T).argmax(-1)  # [S, k]
        if vocab_ids is not None:
            got = vocab_ids[got]
    return (got == tokens[at]).long().cumprod(1).sum(1)


def simulate_rounds(lead: Tensor) -> list[int]:
    """The accepted drafts of each round of one sequence: the first round starts at ``lead[0]``'s position
    and each moves on by its accepted drafts + 1."""
    out, i = [], 0
    while i < len(lead):
        a = int(lead[i])
        out.append(a)
        i += a + 1
    return out


@torch.no_grad()
def heldout_acceptance(
    kind: str,
    draft: nn.Module,
    target: Any,
    data: DistillData,
    k: int,
    lm_w: Tensor | None,
    vocab_ids: Tensor | None,
) -> dict[str, Any]:
    """The held-out figures of the report: greedy rounds at fixed K (see the module docstring);
    ``first_draft_acceptance`` over every position a round could start at."""
    draft.eval()
    accepted: list[int] = []
    first, positions = 0, 0
    for r in range(len(data.tokens)):
        lead = leading_matches(kind, draft, target, r, data, k, lm_w, vocab_ids).cpu()  # read a round at a time
        first += int((lead > 0).sum())
        positions += len(lead)
        accepted += simulate_rounds(lead)
    rounds = max(1, len(accepted))
    return {
        "sequences": len(data.tokens),
        "k": k,
        "rounds": len(accepted),
        "mean_accepted_length": round(1 + sum(accepted) / rounds, 3),
        "acceptance": round(sum(accepted) / (k * rounds), 3),
        "first_draft_acceptance": round(first / max(1, positions), 3),
    }


def heldout_starts(n_ids: int, n: int, opts: DistillOptions) -> list[int]:
    """Up to ``n`` prompt offsets (fewer when the text leaves fewer), seeded apart from training's, each at
    least a prompt and its continuation (``prompt_len + gen_len`` tokens) away from every training prompt's."""
    span = opts.prompt_len + opts.gen_len
    far = n_ids + span  # sentinels below and above every offset
    train = torch.tensor([-far, *sorted(prompt_starts(n_ids, opts.samples, opts.prompt_len, opts.seed)), n_ids + far])
    cand = torch.arange(n_ids - opts.prompt_len)
    i = torch.searchsorted(train, cand)  # train[i - 1] < cand <= train[i]
    free = cand[torch.minimum(cand - train[i - 1], train[i] - cand) >= span]
    g = torch.Generator().manual_seed(opts.seed + 1_000_003)
    return free[torch.randperm(len(free), generator=g)[:n]].sort().values.tolist()


def heldout_data(eng: Any, ids: list[int], n: int, opts: DistillOptions, progress: bool) -> DistillData | None:
    """Greedy continuations (``opts.gen_len`` tokens) of ``n`` prompts of the text ``ids`` from ``heldout_starts``,
    with the target's features for a head. None (logged) when the text leaves no prompt apart from the
    training prompts; fewer (logged) when it leaves fewer."""
    starts = heldout_starts(len(ids), n, opts)
    if len(starts) < n:
        log.warning(
            "held-out evaluation: the text (%d tokens) leaves %d of heldout=%d prompts apart from the training "
            "prompts and their continuations",
            len(ids),
            len(starts),
            n,
        )
    if not starts:
        return None
    seqs, _ = generate(eng, [ids[s : s + opts.prompt_len] for s in starts], opts.gen_len, 0.0, opts.seed, progress)
    return label(eng.target, seqs, 1, opts.kind != "model", opts.prompt_len, progress)
