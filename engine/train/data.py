"""Distillation data for a draft: text the target generates, with its soft labels (and features).

1. ``cut_prompts``: ``n`` prompts of ``prompt_len`` tokens cut at random from a training text (the
   caller's --text or the demo corpus's training split; never the evaluation text).
2. ``generate``: the target continues them through the engine's continuously batched generation
   (a ``greedy_share`` of them greedily, the rest sampled at ``temperature`` with one seed per prompt:
   greedy decoding drafts along the target's greedy text, sampling along sampled text), ``gen_len``
   tokens each (fewer when it emits eos).
3. ``label``: one uncached target forward per group of sequences gives, at every position t, the
   target's top-k log-probs of the token at t + 1 (``vals``, ``idx``) and, for heads, its feature h_t
   (the final-norm output, or with ``Transformer.use_feature_layers`` the hidden states entering those layers
   (EAGLE-3), stored bf16).

``DistillData`` is what training reads; ``save`` / ``load`` cache it (one torch file, written atomically)
so an interrupted training resumes without generating again.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from engine.core.files import write_file_atomic
from engine.core.forward import Features, ForwardCall

log = logging.getLogger(__name__)


@dataclass
class DistillData:
    tokens: Tensor  # [N, T] int64, right-padded with 0
    lengths: Tensor  # [N] int64 real tokens per row
    vals: Tensor  # [N, T, k] float16 target log-probs of its top-k for the token after position t
    idx: Tensor  # [N, T, k] int32 their ids
    features: Tensor | None  # [N, T, H] bfloat16 target features h_t (heads only)
    prompt_len: int
    gen_seconds: float = 0.0
    label_seconds: float = 0.0

    @property
    def generated_tokens(self) -> int:
        return int((self.lengths - self.prompt_len).clamp_min(0).sum())

    def valid(self) -> Tensor:
        """[N, T] bool: positions t whose next token exists (t + 1 < length)."""
        t = torch.arange(self.tokens.shape[1], device=self.lengths.device)
        return t[None] + 1 < self.lengths[:, None]

    def to(self, device: torch.device | str) -> DistillData:
        """The same data with every tensor on ``device`` (training reads it where the draft trains)."""
        moved = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(self).items()}
        return DistillData(**moved)

    def save(self, path: Path) -> None:
        write_file_atomic(path, functools.partial(torch.save, {k: getattr(self, k) for k in self.__dataclass_fields__}))

    @classmethod
    def load(cls, path: Path) -> DistillData:
        return cls(**torch.load(path, weights_only=True))


def prompt_starts(n_ids: int, n: int, prompt_len: int, seed: int) -> list[int]:
    """The offsets of ``cut_prompts``'s windows in a text of ``n_ids`` tokens."""
    if n_ids <= prompt_len:
        raise ValueError(f"the training text has {n_ids} tokens: allowed more than prompt_len={prompt_len}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_ids - prompt_len, (n,), generator=g).tolist()


def cut_prompts(ids: list[int], n: int, prompt_len: int, seed: int) -> list[list[int]]:
    """``n`` windows of ``prompt_len`` tokens of ``ids`` at seeded random offsets."""
    return [ids[s : s + prompt_len] for s in prompt_starts(len(ids), n, prompt_len, seed)]


def generate(
    engine: Any,
    prompts: list[list[int]],
    gen_len: int,
    temperature: float,
    seed: int,
    progress: bool = True,
    chunk: int | None = None,
    greedy_share: float = 0.0,
) -> tuple[list[list[int]], float]:
    """Each prompt + the target's continuation (the engine's batched generation), and the seconds taken.

    Prompts go to the engine ``chunk`` at a time (default: its batch limit, so each chunk runs as one
    batch and the progress bar moves once per batch)."""
    from engine.api.engine import SamplingParams

    chunk = chunk or engine.limits.max_batch
    out: list[list[int]] = []
    t0 = time.perf_counter()
    bar = tqdm(total=len(prompts) * gen_len, desc="generating", unit="tok", disable=not progress, leave=False)
    for i in range(0, len(prompts), chunk):
        group = prompts[i : i + chunk]
        n_greedy = round(greedy_share * len(prompts))  # the first n_greedy prompts are continued greedily
        params = [
            SamplingParams(
                max_new_tokens=gen_len,
                temperature=0.0 if i + j < n_greedy else temperature,
                seed=seed * 1_000_003 + i + j,
            )
            for j in range(len(group))
        ]
        for p, o in zip(group, engine.generate(group, params)):
            out.append(list(p) + list(o.token_ids))
        bar.update(len(group) * gen_len)
    bar.close()
    return out, time.perf_counter() - t0


@torch.no_grad()
def label(
    target: Any,
    seqs: list[list[int]],
    topk: int,
    features: bool,
    prompt_len: int,
    progress: bool = True,
    group_tokens: int = 8192,
) -> DistillData:
    """The target's top-k log-probs (and features) at every position of ``seqs``."""
    t0 = time.perf_counter()
    N, T = len(seqs), max(len(s) for s in seqs)
    tokens = torch.zeros(N, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    vals = torch.empty(N, T, topk, dtype=torch.float16)
    idx = torch.empty(N, T, topk, dtype=torch.int32)
    feats: Tensor | None = None  # [N, T, width of the target's features] (EAGLE-3: its feature layers' 3 H)
    dev = target.norm.weight.device
    g = max(1, group_tokens // T)
    for i in tqdm(range(0, N, g), desc="target labels", disable=not progress, leave=False):
        x = tokens[i : i + g].to(dev)
        out = target.run(ForwardCall(x, features=Features.SCORED))
        logits, h = out.logits, out.features
        top = logits.float().log_softmax(-1).topk(topk, dim=-1)
        vals[i : i + g], idx[i : i + g] = top.values.half().cpu(), top.indices.int().cpu()
        if features:
            if feats is None:
                feats = torch.empty(N, T, h.shape[-1], dtype=torch.bfloat16)
            feats[i : i + g] = h.to(torch.bfloat16).cpu()
    return DistillData(tokens, lengths, vals, idx, feats, prompt_len, label_seconds=time.perf_counter() - t0)
