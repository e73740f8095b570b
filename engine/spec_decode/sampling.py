"""Sampling parameters, logits processing and noise-based sampling.

``process_logits`` turns raw logits into the distribution a request samples
from: temperature -> top-k -> top-p, with the semantics of transformers'
``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``.
Rows are processed together with per-row parameters (no Python loop over
rows), because the same function runs on the decode and verify hot path.

Sampling needs no host synchronisation: its noise is drawn up front (per request,
from the request's own generator). Two samplers pick token ``t`` with probability
``probs[t] / sum(probs)``: the exponential race ``argmax(probs / E)`` with
``E ~ Exp(1)`` [V] (``sample_from_probs``: a draft model's drafts, a residual),
and the inverse CDF at one uniform (``inverse_cdf``: the target's sample at each
position when the drafts are fixed tokens, engine/spec_decode/randomness.py).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from engine.core.errors import InvalidRequestError
from engine.spec_decode.penalties import Penalties
from engine.spec_decode.structured.spec import StructuredOutput

# torch.Generator.manual_seed accepts exactly this range
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
# float32 is what the round computes in: a positive value must stay a normal float32 (not 0, not inf)
_F32_TINY = float(torch.finfo(torch.float32).tiny)
_F32_MAX = float(torch.finfo(torch.float32).max)
# top-k above the vocabulary acts as the vocabulary: larger values are stored as this (an int32 fits any vocabulary)
TOP_K_MAX = 2**31 - 1
# logits are divided or multiplied by the repetition penalty: bounded so that finite logits stay finite
_REP_MIN, _REP_MAX = 1e-6, 1e6


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _real(v: object) -> float | None:
    """``v`` as a float when it is a real number that a float holds (not bool, not an int beyond float), else None."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return None
    try:
        return float(v)
    except OverflowError:
        return None


def _refuse(name: str, value: object, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(f"SamplingParams.{name}={value!r:.80} is invalid: allowed {allowed}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated where they are built.

    ``stop`` accepts a list (or tuple) of strings and is stored as a tuple so the
    object stays immutable and hashable. Beyond temperature / top-k / top-p: ``min_p`` (drop tokens
    below min_p x the top probability), ``repetition_penalty`` (prompt and output tokens),
    ``presence_penalty`` / ``frequency_penalty`` (output tokens, OpenAI's formula),
    ``stop_token_ids`` (end like eos), ``ignore_eos``, ``min_tokens`` (no stop token before that many),
    ``logprobs`` (None, or the number of top alternatives reported with each token's log-probability
    under the target's raw distribution), ``structured`` (None, or the ``StructuredOutput`` the output must
    match: a JSON schema, a regex, a choice, a grammar). Speculation is exact for all of them
    (engine/spec_decode/penalties.py, engine/spec_decode/structured/masks.py).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        mnt = self.max_new_tokens
        if not _is_int(mnt) or mnt < 1:
            raise _refuse("max_new_tokens", mnt, "an int >= 1")
        t = _real(self.temperature)
        if t is None or not (t == 0.0 or _F32_TINY <= t <= _F32_MAX):
            allowed = f"0 (greedy) or a float in [{_F32_TINY:.6g}, {_F32_MAX:.6g}] (float32)"
            raise _refuse("temperature", self.temperature, allowed)
        k = self.top_k
        if not _is_int(k) or k < 0:
            raise _refuse("top_k", k, "an int >= 0 (0 = disabled; values above the vocabulary act as it)")
        p = _real(self.top_p)
        if p is None or not (0.0 < p <= 1.0):  # NaN fails the comparison
            raise _refuse("top_p", self.top_p, "a float in (0, 1] (1 = disabled)")
        s = self.seed
        if s is not None and (not _is_int(s) or not _SEED_MIN <= s <= _SEED_MAX):
            raise _refuse("seed", s, f"None or an int in [{_SEED_MIN}, {_SEED_MAX}]")
        stop = self.stop
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (list, tuple)):
            raise _refuse("stop", stop, "a list of non-empty str")
        for i, item in enumerate(stop):
            if not isinstance(item, str) or not item:
                raise _refuse(f"stop[{i}]", item, "a non-empty str")
        self._check_controls()
        object.__setattr__(self, "max_new_tokens", int(mnt))
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_k", min(int(k), TOP_K_MAX))
        object.__setattr__(self, "top_p", p)
        object.__setattr__(self, "seed", None if s is None else int(s))
        object.__setattr__(self, "stop", tuple(stop))

    def _check_controls(self) -> None:
        mp = _real(self.min_p)
        if mp is None or not (mp == 0 or _F32_TINY <= mp <= 1.0):
            raise _refuse("min_p", self.min_p, f"0 (disabled) or a float in [{_F32_TINY:.6g}, 1] (float32)")
        rp = _real(self.repetition_penalty)
        if rp is None or not _REP_MIN <= rp <= _REP_MAX:
            allowed = f"a float in [{_REP_MIN:g}, {_REP_MAX:g}] (1 = disabled)"
            raise _refuse("repetition_penalty", self.repetition_penalty, allowed)
        for name, v in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            f = _real(v)
            if f is None or not -2.0 <= f <= 2.0:
                raise _refuse(name, v, "a float in [-2, 2] (0 = disabled)")
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
            raise _refuse("stop_token_ids", ids, "a list of int token ids >= 0")
        for i, t in enumerate(ids):
            if not _is_int(t) or t < 0:
                raise _refuse(f"stop_token_ids[{i}]", t, "an int token id >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise _refuse("ignore_eos", self.ignore_eos, "true or false")
        mt = self.min_tokens
        if not _is_int(mt) or not 0 <= mt <= self.max_new_tokens:
            raise _refuse("min_tokens", mt, f"an int in [0, max_new_tokens={self.max_new_tokens}]")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= 20):
            raise _refuse("logprobs", lp, "None or an int in [0, 20] (the top alternatives per token)")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise _refuse("structured", self.structured, "None or a StructuredOutput")
        object.__setattr__(self, "min_p", mp)
        object.__setattr__(self, "repetition_penalty", rp)
        object.__setattr__(self, "presence_penalty", float(self.presence_penalty))
        object.__setattr__(self, "frequency_penalty", float(self.frequency_penalty))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        object.__setattr__(self, "min_tokens", int(mt))

    @property
    def greedy(self) -> bool:
        """True when temperature is 0: the argmax of the raw logits is taken."""
        return self.temperature == 0.0


def params_to_tensors(
    params_list: Sequence[SamplingParams], device: torch.device | str
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row parameter tensors for ``process_logits``.

    Returns temperature [N] float32, top_k [N] int64, top_p [N] float32 on ``device``.
    """
    temperature = torch.tensor([p.temperature for p in params_list], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params_list], dtype=torch.int64, device=device)
    top_p = torch.tensor([p.top_p for p in params_list], dtype=torch.float32, device=device)
    return temperature, top_k, top_p


def process_logits(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor | None = None
) -> Tensor:
    """Logits -> sampling distribution, per row, in fp32.

    logits [N, V] (any float dtype); temperature [N] float32; top_k [N] int64
    (0 = disabled; values above V act as V); top_p [N] float32 in (0, 1]
    (1 = disabled); min_p [N] float32 in [0, 1] or None (0 = disabled). Returns probs [N, V] float32.

    Order and semantics are transformers' temperature -> top-k (ties with the
    k-th value are kept) -> top-p (the smallest set of highest-probability
    tokens whose mass reaches top_p; at least one token is kept) -> min-p (tokens below min_p times
    the largest probability are dropped; transformers' ``MinPLogitsWarper``). Rows with
    temperature 0 get one-hot(argmax of the raw logits), first index on ties.
    The row maximum is subtracted before dividing by the temperature, which
    changes nothing mathematically and keeps tiny temperatures free of inf/NaN.
    """
    x = logits.float()
    n, v = x.shape
    greedy = temperature <= 0  # [N]
    t = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)  # [N, 1]
    scaled = (x - x.amax(dim=-1, keepdim=True)) / t  # [N, V]

    # One descending sort serves both filters: top-k only blanks the tail of it.
    sorted_desc, order = torch.sort(scaled, dim=-1, descending=True)  # [N, V]
    k = top_k.clamp(min=0, max=v)  # [N]
    kth = sorted_desc.gather(-1, (k.clamp(min=1) - 1).unsqueeze(-1))  # [N, 1]
    remove = (k > 0).unsqueeze(-1) & (sorted_desc < kth)  # [N, V], sorted order

    # top-p exactly as transformers does it: ascending order, cumulative
    # softmax mass, drop tokens whose cumulative mass is <= 1 - top_p, keep the top one.
    ascending = sorted_desc.masked_fill(remove, float("-inf")).flip(-1)  # [N, V]
    cum = ascending.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
    drop_p = cum <= (1.0 - top_p).unsqueeze(-1)
    drop_p[:, -1] = False
    drop_p &= (top_p < 1.0).unsqueeze(-1)
    remove |= drop_p.flip(-1)

    remove_orig = torch.empty_like(remove).scatter_(-1, order, remove)  # [N, V], vocab order
    probs = scaled.masked_fill(remove_orig, float("-inf")).softmax(dim=-1)  # [N, V]
    if min_p is not None:
        low = probs < min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)  # never the top token
        probs = probs.masked_fill(low, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    onehot = torch.zeros_like(probs).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(-1), onehot, probs)


def sample_from_probs(probs: Tensor, noise: Tensor) -> Tensor:
    """Exponential-race sample: argmax(probs / noise) per row.

    probs [N, V] non-negative (need not be normalised); noise [N, V] Exp(1).
    Returns [N] int64. A token with probability 0 is never chosen while the row
    has any positive mass; noise that is exactly 0 is treated as the smallest
    positive float so no 0/0 can appear.
    """
    tiny = torch.finfo(torch.float32).tiny
    return torch.argmax(probs.float() / noise.float().clamp_min(tiny), dim=-1)


def inverse_cdf(probs: Tensor, u: Tensor, block: int = 512) -> Tensor:
    """Inverse-CDF sample: the first token whose cumulative mass exceeds u * (the row's mass), per row.

    probs [N, V] non-negative float32 (need not be normalised); u [N] float64 in [0, 1). Returns [N] int64 in
    [0, V). Token t is chosen for u in an interval of length probs[t] / sum(probs): each block of ``block`` tokens
    is summed in float32 (a vectorized pass over V), the blocks and the chosen block's tokens are accumulated in
    float64. A token with probability 0 is never chosen while the row has positive mass; a row without (all zero,
    NaN) gets token 0.
    """
    N, V = probs.shape
    full = V // block
    p = probs.float()
    sums = p[:, : full * block].view(N, full, block).sum(-1)  # [N, full]
    if full * block < V:
        sums = torch.cat([sums, p[:, full * block :].sum(-1, keepdim=True)], 1)  # [N, nb] the tail block
    ends = sums.double().cumsum(-1)  # [N, nb] cumulative mass at each block's end
    x = (u.double() * ends[:, -1]).unsqueeze(-1)  # [N, 1] the point to find
    b = torch.searchsorted(ends, x, right=True).clamp(max=ends.shape[1] - 1)  # [N, 1] the block holding x
    start = torch.where(b > 0, ends.gather(1, (b - 1).clamp(min=0)), 0.0)  # [N, 1]
    cols = b * block + torch.arange(block, device=probs.device)  # [N, block] the block's tokens
    inner = torch.where(cols < V, p.gather(1, cols.clamp(max=V - 1)), 0.0)  # [N, block]
    cum = inner.double().cumsum(-1) + start  # [N, block]
    last = block - 1 - (inner > 0).flip(-1).int().argmax(-1, keepdim=True)  # [N, 1] the block's last positive
    i = torch.searchsorted(cum, x, right=True).clamp(max=last)  # [N, 1] (x past the block's float64 sum: its last)
    return torch.where(ends[:, -1:] > 0, b * block + i, 0)[:, 0]


class Constraint(Protocol):
    """What the rows may emit at each draft position: a grammar (engine/spec_decode/structured/masks.py)."""

    def allowed(self, drafts: Tensor | None, start: int, positions: int) -> Tensor:
        """[B, P, V] bool at draft positions start .. start+P-1, after drafts [B, >= start+P-1] of the round."""
        ...


@dataclass(frozen=True)
class RowProcessing:
    """The per-row processing of one batch, with its fast path chosen on the host.

    ``mode``: "greedy" (every row has temperature 0 and no penalty: one-hot argmax, no sort; a grammar's mask,
    when a row has one, applies first: ``greedy_at``), "softmax" (no row greedy, none filtered by
    top-k/top-p/min-p: a tempered softmax) or "general" (``process_logits``). All three give exactly
    ``process_logits``'s output.
    ``penalties`` (min_tokens, repetition/presence/frequency; engine/spec_decode/penalties.py) apply to the
    logits first, per draft position (``probs_at``); then the ``constraint`` (a grammar's mask: -inf elsewhere).
    """

    temperature: Tensor  # [N] float32
    top_k: Tensor  # [N] int64
    top_p: Tensor  # [N] float32
    mode: str
    min_p: Tensor | None = None  # [N] float32; None: no row uses min-p
    penalties: Penalties | None = None
    constraint: Constraint | None = None

    @classmethod
    def of(
        cls,
        params_list: Sequence[SamplingParams],
        device: torch.device | str,
        history: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
        eos: Sequence[int] = (),
        vocab: int = 0,
        constraint: Constraint | None = None,
    ) -> RowProcessing:
        """history: (prompt, output so far) per row, for the penalties and min_tokens (None: none apply);
        constraint: the rows' grammars (None: no row is constrained)."""

        t, k, p = params_to_tensors(params_list, device)
        pen = None
        if history is not None:
            pen = Penalties.of([(pr, g, sp) for (pr, g), sp in zip(history, params_list)], eos, vocab, device)
        use_min_p = any(x.min_p > 0 for x in params_list)
        min_p = torch.tensor([x.min_p for x in params_list], dtype=torch.float32, device=device) if use_min_p else None
        if all(x.greedy for x in params_list) and pen is None:
            mode = "greedy"
        elif not any(x.greedy or x.top_k > 0 or x.top_p < 1.0 or x.min_p > 0 for x in params_list):
            mode = "softmax"
        else:
            mode = "general"
        return cls(t, k, p, mode, min_p, pen, constraint)

    @property
    def reads_drafts(self) -> bool:
        """Whether a draft position's processing depends on the drafts before it (penalties, a grammar): a drafter
        passes them to ``probs_at``."""
        return self.penalties is not None or self.constraint is not None

    def repeat(self, n: int) -> RowProcessing:
        """Each row repeated n times in place (row b -> rows b*n .. b*n+n-1), without the penalties."""
        mp = None if self.min_p is None else self.min_p.repeat_interleave(n)
        return RowProcessing(
            self.temperature.repeat_interleave(n),
            self.top_k.repeat_interleave(n),
            self.top_p.repeat_interleave(n),
            self.mode,
            mp,
        )

    def probs(self, logits: Tensor) -> Tensor:
        """logits [N, V] (after any penalties) -> probs [N, V] float32."""
        if self.mode == "greedy":
            return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
                -1, logits.argmax(dim=-1, keepdim=True), 1.0
            )
        if self.mode == "softmax":
            x = logits.float()
            return ((x - x.amax(dim=-1, keepdim=True)) / self.temperature.unsqueeze(-1)).softmax(dim=-1)
        return process_logits(logits, self.temperature, self.top_k, self.top_p, self.min_p)

    def greedy_at(self, logits: Tensor, drafts: Tensor) -> Tensor:
        """Greedy mode: logits [B, P, V] at draft positions 0 .. P-1 -> the argmax [B, P] of each, within the
        constraint's mask (drafts [B, >= P-1]: the round's drafts)."""
        if self.constraint is None:
            return logits.argmax(-1)
        allowed = self.constraint.allowed(drafts, 0, logits.shape[1])
        return logits.masked_fill(~allowed, float("-inf")).argmax(-1)

    def probs_at(self, logits: Tensor, drafts: Tensor | None, start: int) -> Tensor:
        """logits [B, P, V] at draft positions start .. start+P-1 of the round -> probs [B, P, V].

        drafts [B, >= start+P-1]: the round's drafts so far (position j's penalties count drafts[:, :j]).
        """
        B, P, V = logits.shape
        x = logits if self.penalties is None else self.penalties.apply(logits, drafts, start)
        if self.constraint is not None:
            x = x.masked_fill(~self.constraint.allowed(drafts, start, P), float("-inf"))
        rows = self if P == 1 else self.repeat(P)
        return rows.probs(x.reshape(B * P, V)).view(B, P, V)
