"""A round's randomness, drawn up front from each sequence's own generator (the one helper for it).

For a sampled row with K_b drafts the round draws, in this order, draft noise E ~ Exp(1) [K_b, V] (one vector
per draft step: the exponential race samples d_i from p_i; none for a drafter of fixed tokens), uniforms
u_1..u_K_b (the acceptance tests) and one final noise vector [V] (the residual or bonus sample). A greedy row
draws nothing. Because every row draws from its own generator, a seeded request's output does not depend on the
rest of the batch. An Exp(1) draw is -log(1 - U) of a float64 uniform U: on the CPU the very bits of torch's
``exponential_``, which takes three times as long (its logarithm is not vectorized).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.core.errors import InvalidConfigError


@dataclass(frozen=True)
class RoundNoise:
    """The draws of one round for a batch of B rows."""

    draft: Tensor | None
    """[B, K, V] float32 Exp(1) per draft step (1 where a row draws none); None: the drafter's drafts are fixed
    tokens, drawn with no noise (``Drafter.samples``)."""
    uniforms: Tensor
    """[B, K] float32 U[0, 1) for the acceptance tests (0.5 where a row draws none)."""
    final: Tensor
    """[B, V] float32 Exp(1) for the one residual or bonus sample (1 for a greedy row)."""

    @classmethod
    def draw(
        cls,
        generators: Sequence[torch.Generator | None],
        ks: Sequence[int],
        sampled: Sequence[bool],
        vocab: int,
        device: torch.device | str,
        drafts: bool = True,
    ) -> RoundNoise:
        """Row b draws from generators[b] (None: the global RNG) K = ks[b] draft vectors (where ``drafts``: the
        drafter samples its drafts) and uniforms, then its final vector, when sampled[b]; K is the widest ks."""
        dev = torch.device(device)
        B, K = len(generators), max(ks, default=0)
        final = torch.ones(B, vocab, device=dev)
        uniforms = torch.full((B, K), 0.5, device=dev)
        draft = torch.ones(B, K, vocab, device=dev) if drafts else None
        for b, (g, k, on) in enumerate(zip(generators, ks, sampled)):
            if not on:
                continue
            if g is not None and g.device.type != dev.type:
                raise InvalidConfigError(
                    f"generators[{b}] lives on {g.device}, but the noise is drawn on {dev}: "
                    f"allowed a generator on {dev.type} or None"
                )
            if k and draft is not None:
                exponential(draft[b, :k], g)
            if k:
                uniforms[b, :k].uniform_(generator=g)
            exponential(final[b], g)
        return cls(draft, uniforms, final)

    def cut(self, k: int) -> RoundNoise:
        """The draws of the first k draft positions (a proposal narrower than asked)."""
        return RoundNoise(None if self.draft is None else self.draft[:, :k], self.uniforms[:, :k], self.final)


def exponential(out: Tensor, g: torch.Generator | None) -> Tensor:
    """``out`` filled with Exp(1) draws from ``g``: -log(1 - U), U ~ U[0, 1) drawn in float64."""
    u = torch.empty(out.shape, dtype=torch.float64, device=out.device).uniform_(generator=g)
    return out.copy_(u.neg_().log1p_().neg_())
