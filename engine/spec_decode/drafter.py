"""The drafter contract: everything a speculative round needs from whoever proposes the drafts.

A round (engine/spec_decode/loop.py) asks the drafter for a ``Proposal`` over a ``DraftBatch``, has the target
verify it, then tells the drafter, per sequence, what was committed (``Committed``): how many of its drafts were
accepted, and the target's features when the drafter reads them (``features``). A drafter keeps its own
per-sequence state (``SeqStates``: a draft cache length, the last feature, ...), catches it up when it drafts
again, and can hand a shared prefill's state to the sequences that start from it. ``cost_step`` is one draft
step for the K controller's cost ratio c (engine/spec_decode/costs.py).

A drafter is one module under engine/spec_decode/drafters/ plus one entry in engine/spec_decode/registry.py;
``DrafterContext`` is what its factory gets (the target, a loaded draft model or head, the kernels chooser).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor, nn

from engine.core.forward import CachedForward, KVCache
from engine.spec_decode.proposal import Proposal
from engine.spec_decode.sampling import RowProcessing

if TYPE_CHECKING:
    from engine.core.model import Transformer
    from engine.spec_decode.heads.config import HeadConfig
    from engine.spec_decode.heads.eagle3 import Eagle3Head
    from engine.spec_decode.heads.eagle_attn import EagleAttnHead
    from engine.spec_decode.seq import Seq
    from engine.spec_decode.step_kernels import AttnStepKernel, EagleStepKernel, MedusaStepKernel


class FeatureNeed(enum.Enum):
    """Which of the target's features (its final-norm outputs, the LM head's inputs) a drafter reads."""

    NONE = "none"
    LAST = "last"  # the feature of the position that scored each sequence's last committed token
    ALL = "all"  # the feature of every committed position (a prefill round returns the prompt's too)


@dataclass
class DraftBatch:
    """What a drafter proposes for: the round's rows and their settings."""

    seqs: list[Seq]
    """The rows, in batch order (their committed tokens: ``Seq.tokens``)."""
    rows: Tensor | None
    """[B] int64 cache rows (None: rows 0..B-1)."""
    processing: RowProcessing
    """Per-row temperature / top-k / top-p / penalties, the same as the target's."""
    k: int
    """Drafts to propose per row at most: the batch's largest K_b."""
    ks: list[int]
    """Each row's own K_b <= k (its drafts past K_b are not verified)."""
    noise: Tensor | None
    """[B, k, V] float32 Exp(1), one vector per draft step; None for an all-greedy batch, or a drafter of fixed
    tokens (``Drafter.samples``)."""
    vocab: int
    """The common vocabulary of draft and target (logits are cut to it)."""
    scratch_pos: int
    """The cache slot padding writes (no real position reads it)."""
    target_cache: KVCache
    """The target's cache (the early-exit drafter writes its first layers)."""
    device: torch.device
    """Where the round runs."""
    tree: bool = True
    """Whether a drafter configured for trees drafts them this round (False: chains; the serving layer measured
    chains faster at this batch, ``KCaps.tree``)."""
    min_accept: float = 0.0
    """The chance of acceptance a draft token must have to pay for its verification at the running batch
    (engine/runtime/draft_cost.py; 0: every draft pays). A drafter that estimates its drafts' acceptance (n-gram)
    proposes none below it for its greedy rows; the others ignore it. Set only for drafters of fixed tokens
    (``Drafter.samples`` False), whose sampled rows' tokens do not depend on their drafts."""
    chains: list[bool] | None = None
    """Rows that take a chain in a tree round (None: none): they read their drafts in order (penalties, min_tokens,
    a sliding window), are sampled under a grammar, or are greedy rows of a sampled batch. The loop cuts what it
    gets for them to its first branch; a drafter whose first branch is shorter than its chain drafts them a chain."""


@dataclass(frozen=True)
class Committed:
    """What one round committed for one sequence, as its drafter is told after verification."""

    n_before: int
    """Committed tokens before the round."""
    accepted: int
    """Drafts of this drafter accepted (0: none, or the row's drafts were not this drafter's)."""
    k: int
    """Drafts the round asked of the drafter (the batch's largest K_b; 0: the drafter did not run)."""
    drafted: bool
    """Whether this drafter's proposal for the row was verified this round (False: it did not run for it)."""
    features: Tensor | None = None
    """The target's features the drafter reads (``FeatureNeed``): LAST [H]; ALL [m, H] for the positions
    committed from the last round's end on (None where the drafter reads none)."""
    verified: int = 0
    """The row's drafts the target verified (its proposal after the loop's cuts: the row's K_b, a grammar's)."""


@runtime_checkable
class Drafter(Protocol):
    """A drafter: see the module docstring."""

    features: FeatureNeed
    """Which target features ``commit`` receives."""
    max_drafts: int | None
    """The most drafts a round can use (Medusa: one per head); None: no limit."""
    samples: bool
    """Whether a sampled round's drafts are drawn from its distributions with the round's draft noise
    (``DraftBatch.noise``, the exact rejection rule); False: fixed tokens (``Proposal.probs`` None), and sampled rows
    draw position noise and take the position rule (engine/spec_decode/randomness.py, acceptance.py)."""

    def propose(self, batch: DraftBatch) -> Proposal:
        """Drafts for every row (a chain of at most ``batch.k``; fewer where it has fewer), with the distributions
        they were drawn from after the target's processing (``Proposal.probs``; None: deterministic, one-hot).

        It keeps nothing per sequence that ``commit`` does not confirm: a round that fails after proposing is
        re-run (the scheduler's fault isolation), and a later round's ``commit`` may say the drafter did not run.
        Caches may be written at positions no committed entry covers yet."""
        ...

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        """Make room for max_batch rows of max_seq_len positions (the target cache's size), keeping what every row
        holds: the target's cache grows while sequences run, and the drafter's with it (``KVCache.grow``)."""
        ...

    def commit(self, seq: Seq, outcome: Committed) -> None:
        """After verification: keep what the round committed, roll back the rejected drafts' state."""
        ...

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        """``src`` has just prefilled its prompt (``length`` tokens) and ``dst`` (same prompt) start from it:
        give them its state of those positions, or leave them as they are (fresh) to prefill themselves."""
        ...

    def catch_up(self, seqs: list[Seq], scratch_pos: int) -> int:
        """Rows whose prompts are in the target's cache (prefilled, or copied from a shared prefill) and that may
        draft: feed what the drafter keeps of their prompts (a draft model's cache) where it has nothing yet, ahead of
        their first draft round and outside the round the K tuner times; ``scratch_pos``: the cache position padding
        writes to. Returns the rows it fed (0: drafters that keep nothing, or catch up on the target's features)."""
        ...

    def cost_step(self, batch: int) -> Callable[[], object] | None:
        """One draft step at ``batch`` sequences (for timing c); None: drafting costs nothing measurable."""
        ...


S = TypeVar("S")


class SeqStates(Generic[S]):
    """A drafter's per-sequence state, kept by the drafter and weakly keyed by the sequence (it goes with it)."""

    def __init__(self, make: Callable[[], S]) -> None:
        self._states: weakref.WeakKeyDictionary[Seq, S] = weakref.WeakKeyDictionary()
        self._make = make

    def __call__(self, seq: Seq) -> S:
        """The sequence's state, made fresh on first use."""
        st = self._states.get(seq)
        if st is None:
            st = self._states[seq] = self._make()
        return st

    def get(self, seq: Seq) -> S | None:
        return self._states.get(seq)

    def put(self, seq: Seq, state: S) -> None:
        self._states[seq] = state


class StepFn(Protocol):
    """A drafter's per-step computation on batch-first tensors, then its static (non-tensor) arguments."""

    def __call__(self, *args: Any) -> Any: ...


class DraftKernels(Protocol):
    """The kernels a drafter may run its steps on, chosen by the kernels layer (engine/kernels/draft_kernels.py):
    the CPU's one-call C++ steps of the trained heads and CUDA graphs of a step. Each returns None where the
    choice is to stay on PyTorch (the reason is logged there)."""

    cuda_graphs: bool
    """Whether the engine captures CUDA graphs (a drafter that cannot be graphed refuses at build)."""

    def eagle_step(
        self, head: nn.Module, embed: Tensor, scorer: nn.Linear, vocab_ids: Tensor | None, eps: float
    ) -> EagleStepKernel | None:
        """An EAGLE head's step on a kernel, or None."""
        ...

    def medusa_step(
        self, head: nn.Module, scorer: nn.Linear, vocab_ids: Tensor | None, vocab: int
    ) -> MedusaStepKernel | None:
        """Medusa heads' step on a kernel, or None."""
        ...

    def attn_head_step(self, head: EagleAttnHead, scorer: nn.Linear) -> AttnStepKernel | None:
        """The attention head's layers, output norm and scores on a kernel, or None."""
        ...

    def eagle3_step(self, head: Eagle3Head) -> AttnStepKernel | None:
        """The EAGLE-3 head's layer, norm and its own scores on a kernel, or None."""
        ...

    def scorer(self, scorer: nn.Linear) -> nn.Module:
        """The LM head rows a head scores with: on the few-row GEMM where the CPU kernels run and CUDA graphs are off
        (graphs capture PyTorch's op; ``cpu_pack=False`` keeps PyTorch's), else as it is."""
        ...

    def graph_step(self, fn: Callable[..., Any], name: str, n_static: int = 0) -> StepFn | None:
        """``fn`` (its ``n_static`` trailing arguments not tensors) replayed from CUDA graphs per batch bucket,
        called as ``fn``; None when graphs are off."""
        ...


@dataclass(frozen=True)
class LoadedHead:
    """A trained head loaded and checked against the target (engine/spec_decode/heads/checkpoint.py)."""

    module: nn.Module
    config: HeadConfig
    vocab_ids: Tensor | None
    """[V'] the reduced draft vocabulary's ids in the target's, or None (the full vocabulary)."""


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter's factory (its registry entry's ``build``) gets."""

    target: CachedForward
    """The target's forward (CUDA-graphed when graphs are on): the early-exit drafter runs its first layers."""
    target_module: Transformer
    """The target itself: its embedding and LM head, which the heads share (the verifier's precision)."""
    kernels: DraftKernels
    """The kernels chooser for the drafter's steps."""
    draft_model: CachedForward | None = None
    """A loaded draft checkpoint's forward (entries that load a draft model)."""
    draft_module: Transformer | None = None
    """That draft model itself (its config, cache dtype and device; costs time it eagerly)."""
    head: LoadedHead | None = None
    """A loaded trained head (entries that load a head)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The entry's own SpeculationConfig fields (``DrafterEntry.fields``) and their values."""
