"""CUDA graphs for a trained draft head's step (engine/spec_decode/drafters/medusa.py, eagle.py).

``GraphedStep(fn, device, buckets, n_static=0)`` wraps a batch-first function of tensors, the drafter's
per-step computation, and is called like it: for eagle ``(feature [B, H], token [B]) -> (next feature,
scores over the draft vocabulary)`` (the head's forward on the token's embedding, then the shared LM
head's rows), for medusa ``(feature [B, H], n) -> scores [B, n, V']`` (``n`` its one static argument:
``n_static=1``, the trailing arguments that are not tensors). A call is
replayed from the graph of its key (batch bucket, static arguments, the inputs' shapes after the
batch dimension and dtypes), captured on first use; padding rows get zero inputs and their outputs
are cut off. A batch above the largest bucket runs eagerly and is counted. A head keeps no cache,
so no graph is ever dropped for one; the least recently used go past ``max_graphs``.
``emulate=True`` runs the same padded static call without capturing (what the CPU tests check).
Sampling between steps stays eager, as for a draft model's step graph.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.core.errors import InvalidConfigError
from engine.kernels.cudagraphs import (
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_MAX_GRAPHS,
    GraphPool,
    GraphStats,
    batch_bucket,
    capture,
    check_buckets,
    cut_rows,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepKey:
    batch: int
    static: tuple[Any, ...]  # the call's non-tensor arguments
    inputs: tuple[tuple[tuple[int, ...], torch.dtype], ...]  # each input's shape after the batch dim, and dtype


class _StaticStep:
    def __init__(self, key: StepKey, device: torch.device) -> None:
        self.inputs = [torch.zeros(key.batch, *shape, dtype=dt, device=device) for shape, dt in key.inputs]
        self.out: Any = None
        self.graph: Any = None


class GraphedStep:
    """``fn(*tensors, *static)`` from CUDA graphs per batch bucket (see the module doc), called as ``fn``."""

    def __init__(
        self,
        fn: Callable[..., Any],
        device: torch.device,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        *,
        emulate: bool = False,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        pool: GraphPool | None = None,
        name: str = "head step",
        n_static: int = 0,
    ) -> None:
        if not emulate and device.type != "cuda":
            raise InvalidConfigError(
                f"CUDA graphs of the {name} need a CUDA device, not {device.type!r} "
                "(emulate=True runs the static step eagerly)"
            )
        self.fn, self.device, self.emulate, self.name, self.n_static = fn, device, emulate, name, n_static
        self.buckets = check_buckets(list(batch_buckets), "batch_buckets")
        self.max_graphs = max_graphs
        self.pool = pool if pool is not None or emulate else GraphPool(device)
        self.stats = GraphStats()
        self._graphs: OrderedDict[StepKey, _StaticStep] = OrderedDict()

    def key_for(self, inputs: Sequence[Tensor], static: tuple[Any, ...] = ()) -> StepKey | None:
        """The graph a call would replay, or None (eager: a batch above the buckets)."""
        bb = batch_bucket(inputs[0].shape[0], self.buckets)
        if bb is None:
            return None
        return StepKey(bb, tuple(static), tuple((tuple(x.shape[1:]), x.dtype) for x in inputs))

    def __call__(self, *args: Any) -> Any:
        """``fn(*args)``: its tensors, then its ``n_static`` static arguments."""
        cut = len(args) - self.n_static
        inputs, static = args[:cut], tuple(args[cut:])
        key = self.key_for(inputs, static)
        if key is None:
            self.stats.eager_calls += 1
            return self.fn(*inputs, *static)
        g = self._graphs.get(key)
        fresh = g is None
        if g is None:
            g = self._graphs[key] = _StaticStep(key, self.device)
        else:
            self._graphs.move_to_end(key)
        B = inputs[0].shape[0]
        for dst, src in zip(g.inputs, inputs):
            dst[:B].copy_(src)
            dst[B:].zero_()  # padding rows: zero features, token 0
        if self.emulate:
            out = self._run(g, key)
            if fresh:
                self._count_capture(0.0)
        else:
            if fresh:
                g.graph, g.out, dt = capture(lambda: self._run(g, key), self.device, self.pool)
                log.debug("captured the CUDA graph of the %s %s in %.3f s", self.name, key, dt)
                self._count_capture(dt)
            g.graph.replay()
            out = g.out
        self.stats.replays += 1
        return cut_rows(out, B)

    @torch.no_grad()
    def _run(self, g: _StaticStep, key: StepKey) -> Any:
        return self.fn(*g.inputs, *key.static)

    def _count_capture(self, seconds: float) -> None:
        self.stats.captures += 1
        self.stats.capture_seconds += seconds
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats.evictions += 1
        self.stats.graphs = len(self._graphs)
