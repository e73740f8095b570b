"""A round's randomness, drawn up front from each sequence's own generator (the one module for it).

Two layouts, by what the drafter proposes:

* ``PositionNoise`` (drafts of fixed tokens: n-gram, suffix, or no drafter): one float64 uniform per scored position
  of a sampled row. The target's sample at a position is the inverse CDF of its distribution there at the
  position's uniform, and the drafts are accepted while they equal those samples, so every committed token is the
  one plain sampling would commit with that uniform. Each position's uniform is its own draw and the generator is
  rewound past the positions the row commits (``rewind``): a row consumes one draw per token whatever its K or
  draft shape, and a seeded row's tokens are those of plain sampling with the same seed (where the target's logits
  are the same bits in every pass, as on the CPU's C++ step).
* ``RoundNoise`` (a drafter that samples its drafts: a draft model, a head): for a row with K_b drafts the round
  draws draft noise E ~ Exp(1) [K_b, V] (the exponential race samples d_i from p_i), uniforms u_1..u_K_b (the
  acceptance tests) and one final noise vector [V] (the residual or bonus sample).

A greedy row draws nothing. Because every row draws from its own generator, a seeded request's output does not
depend on the rest of the batch. An Exp(1) draw is -log(1 - U) of a float64 uniform U: on the CPU the very bits of
torch's ``exponential_``, which takes three times as long (its logarithm is not vectorized).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.core.errors import InvalidConfigError

Generators = Sequence[torch.Generator | None]  # one per row (None: the global RNG)
Device = torch.device | str


@dataclass(frozen=True)
class PositionNoise:
    """The draws of one round for a batch of B rows whose drafts are fixed tokens: one uniform per scored position."""

    uniforms: Tensor
    """[B, K+1] float64 U[0, 1): column j samples the target at the round's j-th scored position (a tree: at depth
    j); 0.5 where a row draws none."""
    marks: list[list[Tensor]]
    """Per row: its generator's state after each of its draws (empty: a greedy row)."""

    @classmethod
    def draw(cls, generators: Generators, ks: Sequence[int], sampled: Sequence[bool], device: Device) -> PositionNoise:
        """Row b draws ks[b] + 1 uniforms from generators[b] (None: the global RNG), each its own draw, when
        sampled[b]; the tensor is as wide as the widest ks + 1."""
        dev = torch.device(device)
        uniforms = torch.full((len(generators), max(ks, default=0) + 1), 0.5, dtype=torch.float64, device=dev)
        marks: list[list[Tensor]] = []
        for b, (g, k, on) in enumerate(zip(generators, ks, sampled)):
            _check_device(g, dev, b)
            marks.append([])
            for j in range(k + 1 if on else 0):  # one draw per position: the stream a plain row draws
                uniforms[b, j : j + 1].uniform_(generator=g)
                if g is not None:
                    marks[b].append(g.get_state())
        return cls(uniforms, marks)

    def rewind(self, b: int, generator: torch.Generator, used: int) -> None:
        """Row b committed ``used`` tokens: its generator continues after its first ``used`` draws."""
        if 0 < used < len(self.marks[b]):
            generator.set_state(self.marks[b][used - 1])

    def cut(self, k: int) -> PositionNoise:
        """The draws of the first k draft positions and the next (a proposal narrower than asked)."""
        return PositionNoise(self.uniforms[:, : k + 1], self.marks)


@dataclass(frozen=True)
class RoundNoise:
    """The draws of one round for a batch of B rows whose drafter samples its drafts."""

    draft: Tensor
    """[B, K, V] float32 Exp(1) per draft step (1 where a row draws none)."""
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
    ) -> RoundNoise:
        """Row b draws from generators[b] (None: the global RNG) K = ks[b] draft vectors and uniforms, then its
        final vector, when sampled[b]; K is the widest ks."""
        dev = torch.device(device)
        B, K = len(generators), max(ks, default=0)
        final = torch.ones(B, vocab, device=dev)
        uniforms = torch.full((B, K), 0.5, device=dev)
        draft = torch.ones(B, K, vocab, device=dev)
        for b, (g, k, on) in enumerate(zip(generators, ks, sampled)):
            if not on:
                continue
            _check_device(g, dev, b)
            if k:
                exponential(draft[b, :k], g)
                uniforms[b, :k].uniform_(generator=g)
            exponential(final[b], g)
        return cls(draft, uniforms, final)

    def cut(self, k: int) -> RoundNoise:
        """The draws of the first k draft positions (a proposal narrower than asked)."""
        return RoundNoise(self.draft[:, :k], self.uniforms[:, :k], self.final)


def _check_device(g: torch.Generator | None, dev: torch.device, b: int) -> None:
    if g is not None and g.device.type != dev.type:
        raise InvalidConfigError(
            f"generators[{b}] lives on {g.device}, but the noise is drawn on {dev}: "
            f"allowed a generator on {dev.type} or None"
        )


def exponential(out: Tensor, g: torch.Generator | None) -> Tensor:
    """``out`` filled with Exp(1) draws from ``g``: -log(1 - U), U ~ U[0, 1) drawn in float64."""
    u = torch.empty(out.shape, dtype=torch.float64, device=out.device).uniform_(generator=g)
    return out.copy_(u.neg_().log1p_().neg_())
