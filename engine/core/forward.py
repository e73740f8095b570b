"""What one forward of the decoder takes and returns, the static KV cache it reads and writes, and the
contracts of the parts that run forwards: a step kernel (engine/kernels/cpu_decode.py) and a cached forward
(a ``Transformer``, engine/core/model.py, or its CUDA-graphed wrapper, engine/kernels/cudagraphs.py)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from engine.core.config import ModelConfig


class KVCache:
    """Static cache: k, v [layers, max_batch, kv_heads, max_seq_len, head_dim]."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_batch: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        n_layers: int | None = None,
    ) -> None:
        n = cfg.num_hidden_layers if n_layers is None else n_layers
        shape = (n, max_batch, cfg.num_key_value_heads, max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def grow(self, max_batch: int, max_seq_len: int) -> None:
        """Make room for at least ``max_batch`` rows of ``max_seq_len`` positions, keeping every row's keys and
        values at their positions (the new rows and positions zero). The tensors are new: a CUDA graph that
        captured the old ones must be dropped (engine/kernels/cudagraphs.py checks the addresses)."""
        n, rows, heads, slots, dim = self.k.shape
        shape = (n, max(rows, max_batch), heads, max(slots, max_seq_len), dim)
        if shape[1] == rows and shape[3] == slots:
            return
        k, v = _grown(self.k, shape), _grown(self.v, shape)  # both allocated before either is swapped
        self.k, self.v = k, v
        self.max_batch, self.max_seq_len = shape[1], shape[3]

    def copy_rows(self, src: int, dst: Sequence[int], length: int) -> None:
        """Copy positions 0..length-1 of row ``src`` (every layer, keys and values) into the rows ``dst``."""
        assert 0 <= length <= self.max_seq_len, f"length {length} beyond the cache's {self.max_seq_len} positions"
        if not dst or not length:
            return
        idx = torch.tensor(list(dst), dtype=torch.long, device=self.k.device)
        for t in (self.k, self.v):
            t[:, idx, :, :length] = t[:, src : src + 1, :, :length]

    def move(self, row: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the keys and values of slots ``src`` of ``row`` to slots ``dst`` (every layer): a draft tree's
        accepted path into consecutive slots. Only the pairs that differ move."""
        pairs = [(a, b) for a, b in zip(src, dst) if a != b]
        if not pairs:
            return
        s = torch.tensor([a for a, _ in pairs], device=self.k.device)
        d = torch.tensor([b for _, b in pairs], device=self.k.device)
        for t in (self.k, self.v):
            t[:, row, :, d] = t[:, row, :, s]  # (src is gathered before dst is written)


def _grown(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A zero tensor of ``shape`` holding ``t`` in its leading corner (rows and positions kept)."""
    out = torch.zeros(shape, dtype=t.dtype, device=t.device)
    out[:, : t.shape[1], :, : t.shape[3]] = t
    return out


class Features(enum.Enum):
    """Which final-norm outputs (the LM head's inputs: the features draft heads read) a forward returns."""

    NONE = "none"
    SCORED = "scored"  # of the scored positions, shaped like the logits: [B, H] or [B, J, H]
    ALL = "all"  # of every position [B, T, H] (logits still only of the scored ones)


@dataclass(frozen=True)
class TreeMask:
    """A draft tree's layout in a verify pass: nodes at depth-based positions, each in its own cache slot,
    each query seeing the committed context, its ancestors and itself (engine/spec_decode/tree.py builds it)."""

    slots: Tensor
    """[B, T] int64 cache slots the call's keys are written to (positions follow depth; slots are distinct)."""
    mask: Tensor
    """[B, 1, T, kv_len] bool: key slot j is visible to query t."""


@dataclass(frozen=True)
class ForwardCall:
    """One forward of the decoder: what ``Transformer.run`` (and its kernels and graphs) take."""

    tokens: Tensor
    """[B, T] int64 token ids."""
    pos: Tensor | None = None
    """[B, T] int64 positions; None: 0..T-1."""
    cache: KVCache | None = None
    """The static KV cache written at ``pos`` and attended over; None: a plain causal forward."""
    kv_len: int | None = None
    """Cache slots attended over (> every position of the batch); required with a cache."""
    rows: Tensor | None = None
    """[B] int64 cache rows of the batch, or [B, T] a cache row per token (a packed pass: tokens of several
    sequences in one row of the batch, each written at its own row and position and seeing that row's keys up to
    its position, those of this call included); None: rows 0..B-1."""
    logits_idx: Tensor | None = None
    """Positions to score: [B] -> logits [B, V], [B, J] -> [B, J, V]; None: every position [B, T, V]."""
    n_layers: int | None = None
    """Run only the first n layers (early-exit drafting), then the final norm and the LM head."""
    start: int | None = None
    """A promise: rows is None and pos[b] == start..start+T-1 for every b (slice writes, no gather)."""
    features: Features = Features.NONE
    """Also return final-norm outputs (``ForwardOut.features``)."""
    tree: TreeMask | None = None
    """A draft tree's slots and mask (None: keys written at ``pos``, the position mask); no ``start``."""


@dataclass(frozen=True)
class ForwardOut:
    """A forward's logits and, when asked, its features."""

    logits: Tensor
    features: Tensor | None = None


class StepKernel(Protocol):
    """A model's cached forward as one call (engine/kernels/cpu_decode.py ``DecodeStep``): the same inputs
    and results as PyTorch's layers for the calls it ``takes``."""

    weight_dtype: torch.dtype
    amx: bool

    def takes(self, call: ForwardCall) -> bool:
        """Whether this call runs on the kernel."""
        ...

    def run(self, call: ForwardCall, feature_layers: tuple[int, ...] = ()) -> ForwardOut:
        """The forward of ``call``; with ``feature_layers`` its features are the hidden states entering those
        layers, concatenated, in place of the final-norm outputs."""
        ...

    def greedy(self, call: ForwardCall, last: Tensor, steps: int, vocab: int) -> Tensor:
        """Greedy drafting in one call: ``call`` scored at ``last`` [B], then ``steps`` - 1 one-token steps on
        the argmax over the first ``vocab`` logits -> the argmaxes [B, steps]."""
        ...


class CachedForward(Protocol):
    """What the decode loop and the drafters call a model through: a ``Transformer`` or its CUDA-graphed
    wrapper (engine/kernels/cudagraphs.py)."""

    config: ModelConfig

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (a KV cache for it holds this dtype)."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the model's weights are."""
        ...

    def run(self, call: ForwardCall) -> ForwardOut:
        """The forward of ``call``."""
        ...

    def greedy_draft(self, call: ForwardCall, last: Tensor, steps: int, vocab: int) -> Tensor | None:
        """``steps`` greedy drafts in one call where a step kernel runs ``call``, else None."""
        ...

    def packs(self, cache: KVCache) -> bool:
        """Whether a call over ``cache`` with a cache row per token (``ForwardCall.rows`` [B, T]) runs here."""
        ...
