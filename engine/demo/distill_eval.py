"""How well a trained draft drafts: the engine's greedy rounds, simulated on held-out text.

The held-out sequences are continuations the target generated greedily from prompts that training
never saw. At every position L where a round could start (its first draft proposes the token at L),
the draft proposes K tokens along the target's own greedy text: while its drafts match, they are the
tokens the round commits, so teacher forcing gives exactly the engine's drafts. ``leading_matches``
counts the leading drafts equal to the target's argmax; a greedy round at fixed K starting at L
commits that many + 1 tokens. Hopping through each sequence from its first generated token, as the
engine's rounds do, gives the mean accepted length and the acceptance rate that ``tools/bench.py``
reports for greedy decoding at that K (up to the positions the bench's own prompts lead to).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from engine.demo.distill_data import DistillData, cut_prompts, generate, label


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
    """[S] int: for each start L in 2 .. S + 1 (S = length - k - 1), how many of the k drafts of a round
    whose first draft is the token at L equal the target's argmax before the first one that does not.

    kind "model": ``draft`` is a draft model (teacher-forced on the row); "eagle" / "medusa": a head on
    the target's features ``data.features``, scored by ``lm_w`` [V', H] (rows ``vocab_ids`` [V'] of the
    target's LM head, or all of it when None)."""
    n = int(data.lengths[row])
    tokens = data.tokens[row, :n]  # [n]
    best = data.idx[row, :n, 0].long()  # [n]: the target's argmax for the token after each position
    starts = torch.arange(2, n - k + 1)  # [S]: first draft at L, its k-th at L + k - 1 <= n - 1
    want = best[starts[:, None] - 1 + torch.arange(k)]  # [S, k]: the target's token at L + j
    if kind == "model":
        pred = draft(tokens[None])[0].argmax(-1)  # [n]: the draft's token after each position
        got = pred[starts[:, None] - 1 + torch.arange(k)]
    else:
        assert data.features is not None and lm_w is not None
        f = data.features[row, starts - 2].float()  # [S, H]: the feature that scored the token at L - 1
        if kind == "medusa":
            feats = draft(f, k)  # [S, k, H]
        else:
            emb = target.embed_tokens(tokens[starts[:, None] - 1 + torch.arange(k)]).float()  # [S, k, H]
            steps = []
            for j in range(k):
                f = draft(f, emb[:, j])
                steps.append(f)
            feats = torch.stack(steps, 1)
        got = (feats @ lm_w.T).argmax(-1)  # [S, k]
        if vocab_ids is not None:
            got = vocab_ids[got]
    return (got == want).long().cumprod(1).sum(1)


def simulate_rounds(lead: Tensor, prompt_len: int) -> list[int]:
    """The accepted drafts of each round of one sequence: rounds start after the prefill's token
    (L = prompt_len + 1) and each moves L on by its accepted drafts + 1. ``lead[i]``: start L = i + 2."""
    out, L = [], prompt_len + 1
    while 0 <= L - 2 < len(lead):
        a = int(lead[L - 2])
        out.append(a)
        L += a + 1
    return out


@torch.no_grad()
def heldout_acceptance(
    kind: str, draft: nn.Module, target: Any, data: DistillData, k: int, lm_w: Tensor | None, vocab_ids: Tensor | None
) -> dict[str, Any]:
    """The held-out figures of the report: greedy rounds at fixed K (see the module docstring)."""
    draft.eval()
    accepted: list[int] = []
    first, positions = 0, 0
    for r in range(len(data.tokens)):
        lead = leading_matches(kind, draft, target, r, data, k, lm_w, vocab_ids)
        first += int((lead > 0).sum())
        positions += len(lead)
        accepted += simulate_rounds(lead, data.prompt_len)
    rounds = max(1, len(accepted))
    return {
        "sequences": len(data.tokens),
        "k": k,
        "rounds": len(accepted),
        "mean_accepted_length": round(1 + sum(accepted) / rounds, 3),
        "acceptance": round(sum(accepted) / (k * rounds), 3),
        "first_draft_acceptance": round(first / max(1, positions), 3),
    }


def heldout_data(eng: Any, text: str, n: int, opts: Any, path: Path, progress: bool) -> DistillData:
    """``n`` greedy continuations (``opts.gen_len`` tokens) of prompts cut from ``text`` with another seed
    than the training prompts' (``opts``: the TrainOptions), labelled with the target's argmax (and
    features for a head); cached at ``path``."""
    if path.is_file():
        return DistillData.load(path)
    prompts = cut_prompts(eng.tokenizer.encode(text), n, opts.prompt_len, opts.seed + 1_000_003)
    seqs, _ = generate(eng, prompts, opts.gen_len, 0.0, opts.seed, progress, greedy_share=1.0)
    data = label(eng.target, seqs, 1, opts.kind != "model", opts.prompt_len, progress)
    data.save(path)
    return data
