"""CUDA graphs for the decode loop's cached forwards (target verify, draft steps).

``GraphedForward`` wraps a Transformer as a ``CachedForward`` (engine/core/forward.py): its ``run`` is the
model's cached forward, replayed from a captured graph when the call fits one, so the loop
(``loop.target``) and a drafter (``drafter.model``) use it in place of the model.
``graph_forwards(target, draft, k_max, buckets)`` makes the wrappers the engine's builder installs.

A graph is keyed by (batch bucket, T, logits_idx shape, kv bucket, row layout,
n_layers) and captured lazily on first use:

- batch: the smallest bucket (1, 2, 4, 8, 16, 32 by default) >= B; padding rows
  get token 0 at the cache's scratch position (written, never read by a real
  query) and, with explicit rows, cache row 0; their outputs are cut off.
- T: one graph per verify width T = K + 1 the controller picks. One graph at
  k_max with masked padding would verify up to k_max + 1 tokens for a K = 2
  round: free at batch 1 (weight-bound), not at batch 32 where the GEMMs see 288
  instead of 96 rows; k_min..k_max is a handful of widths, so per-T graphs cost
  a few captures and no extra compute per round.
- kv: the attention spans a fixed number of cache slots, the power of two >= kv_len
  (at least 256, at most the cache length), with the position mask computed inside
  the graph from the static positions; at most 2x the live KV is read.
- the draft: its one-token step (and the T <= 2 catch-up) is graphed and replayed
  K - 1 times; sampling between steps stays eager. A graph of the whole K-step
  loop would need one graph per (bucket, K, sampling set-up) and the top-k/top-p
  branches are chosen on the host per batch; the step graph serves every K.

A verify that returns the target's features too (``Features.SCORED``, for a head drafter) has graphs of
its own (``hidden`` in the key); the head's step is graphed by engine/kernels/head_graphs.py.

A call that fits no graph (no cache, prefill wider than ``max_tokens``, a batch
above the largest bucket or the cache's rows, every position's features: ``Features.ALL``)
runs eagerly and is counted. A new cache (the scheduler grows it between rounds) drops the graphs. ``emulate=True``
runs the same static padded forward without capturing (what the CPU tests check).
Graphs share one memory pool (``GraphPool``); outputs are cloned right after replay, so a later
replay of another graph never overwrites what a caller holds.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from engine.core.config import ModelConfig
from engine.core.errors import InvalidConfigError
from engine.core.model import Features, ForwardCall, ForwardOut, KVCache, Transformer

log = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
KV_BUCKET_MIN = 256
DEFAULT_MAX_GRAPHS = 96


def check_buckets(buckets: Sequence[int], where: str = "runtime.cuda_graphs.batch_buckets") -> tuple[int, ...]:
    """Sorted distinct positive ints; InvalidConfigError naming ``where`` otherwise."""
    if (
        not isinstance(buckets, (list, tuple))
        or not buckets
        or any(not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= 4096 for b in buckets)
    ):
        raise InvalidConfigError(f"{where}={buckets!r} is invalid: allowed a non-empty list of ints in 1..4096")
    return tuple(sorted(set(buckets)))


def batch_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n, or None when n is above them all."""
    return next((b for b in buckets if b >= n), None)


def kv_bucket(kv_len: int, max_seq_len: int) -> int:
    """Cache slots a graph attends over: the power of two >= kv_len (>= KV_BUCKET_MIN), capped by the cache."""
    b = KV_BUCKET_MIN
    while b < kv_len:
        b *= 2
    return min(b, max_seq_len)


@dataclass(frozen=True)
class GraphKey:
    batch: int
    tokens: int  # T
    idx: tuple[int, ...] | None  # logits_idx shape without the batch dim (None: no logits_idx)
    kv: int
    prefix: bool  # rows 0..B-1 (no rows tensor: no gather of the cache)
    n_layers: int | None
    hidden: bool = False  # Features.SCORED: logits and features, for the drafters of trained heads


@dataclass
class GraphStats:
    graphs: int = 0  # held now
    captures: int = 0
    capture_seconds: float = 0.0
    replays: int = 0
    eager_calls: int = 0
    evictions: int = 0
    resets: int = 0  # the cache was replaced: graphs dropped

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Static:
    """Static inputs of one graph and, once captured, its output and the graph."""

    def __init__(self, key: GraphKey, device: torch.device) -> None:
        B, T = key.batch, key.tokens
        self.tokens = torch.zeros(B, T, dtype=torch.long, device=device)
        self.pos = torch.zeros(B, T, dtype=torch.long, device=device)
        self.rows = None if key.prefix else torch.zeros(B, dtype=torch.long, device=device)
        self.idx = None if key.idx is None else torch.zeros(B, *key.idx, dtype=torch.long, device=device)
        self.out: ForwardOut | None = None
        self.graph: Any = None  # torch.cuda.CUDAGraph


class GraphedForward:
    """The cached forward of ``model`` from CUDA graphs where the call fits one (see the module doc)."""

    def __init__(
        self,
        model: Transformer,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        *,
        max_tokens: int = 16,
        emulate: bool = False,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        pool: GraphPool | None = None,
    ) -> None:
        dev = model.norm.weight.device
        if not emulate and dev.type != "cuda":
            raise InvalidConfigError(
                f"CUDA graphs need the model on a CUDA device, not {dev.type!r} "
                "(emulate=True runs the static forward eagerly)"
            )
        self._model, self.device, self.emulate = model, dev, emulate
        self.buckets = check_buckets(list(batch_buckets), "batch_buckets")
        self.max_tokens, self.max_graphs = max_tokens, max_graphs
        self.pool = pool if pool is not None or emulate else GraphPool(dev)
        self.stats = GraphStats()
        self._graphs: OrderedDict[GraphKey, _Static] = OrderedDict()
        self._cache_id: tuple[int, ...] | None = None

    @property
    def model(self) -> Transformer:
        return self._model

    @property
    def config(self) -> ModelConfig:
        return self._model.config

    @property
    def dtype(self) -> torch.dtype:
        return self._model.dtype

    # ------------------------------------------------------------ the call
    def key_for(self, call: ForwardCall) -> GraphKey | None:
        """The graph a call would replay, or None (eager)."""
        cache = call.cache
        if cache is None or call.pos is None or call.kv_len is None or call.features is Features.ALL:
            return None
        if call.tree is not None:  # a draft tree's masked verify runs eagerly
            return None
        B, T = call.tokens.shape
        bb = batch_bucket(B, self.buckets)
        if bb is None or bb > cache.max_batch or T > self.max_tokens:
            return None
        idx = None if call.logits_idx is None else tuple(call.logits_idx.shape[1:])
        hidden = call.features is Features.SCORED
        kv = kv_bucket(call.kv_len, cache.max_seq_len)
        return GraphKey(bb, T, idx, kv, call.rows is None, call.n_layers, hidden)

    def run(self, call: ForwardCall) -> ForwardOut:
        """``call`` replayed from its graph (captured on first use), or run eagerly (counted) when it fits none;
        every position's features (a prefill for the attention head) have no graph."""
        key = self.key_for(call)
        if key is None:
            self.stats.eager_calls += 1
            return self._model.run(call)
        assert call.cache is not None and call.pos is not None
        self._check_cache(call.cache)
        g = self._graphs.get(key)
        fresh = g is None
        if g is None:
            g = self._graphs[key] = _Static(key, self.device)
        else:
            self._graphs.move_to_end(key)
        self._fill(g, call, call.cache.max_seq_len - 1)
        if self.emulate:
            out = self._forward(g, call.cache, key)
            if fresh:
                self._count_capture(0.0)
        else:
            if fresh:
                self._capture(g, call.cache, key)
            g.graph.replay()
            out = g.out
        self.stats.replays += 1  # emulated: the same static forward, run eagerly
        assert out is not None
        n = call.tokens.shape[0]
        return ForwardOut(out.logits[:n].clone(), None if out.features is None else out.features[:n].clone())

    def greedy_draft(self, call: ForwardCall, last: Tensor, steps: int, vocab: int) -> Tensor | None:
        """The model's one-call greedy drafting where its step kernel runs (never on CUDA): graphs replay steps."""
        return self._model.greedy_draft(call, last, steps, vocab)

    def packs(self, cache: KVCache) -> bool:
        """Never: a graph's batch holds one cache row per sequence (the verify pass stays padded)."""
        return False

    # ------------------------------------------------------------ internals
    def _check_cache(self, cache: KVCache) -> None:
        ident = (cache.k.data_ptr(), cache.v.data_ptr(), *cache.k.shape)
        if self._cache_id != ident:
            if self._graphs:
                log.info("KV cache replaced: dropping %d CUDA graphs", len(self._graphs))
                self.stats.resets += 1
            self.reset()
            self._cache_id = ident

    def reset(self) -> None:
        """Drop every graph (they hold the old cache's addresses)."""
        self._graphs.clear()
        self.stats.graphs = 0

    @staticmethod
    def _fill(g: _Static, call: ForwardCall, scratch: int) -> None:
        B = call.tokens.shape[0]
        assert call.pos is not None
        g.tokens[:B].copy_(call.tokens)
        g.tokens[B:].zero_()
        g.pos[:B].copy_(call.pos)
        g.pos[B:].fill_(scratch)  # padding rows write the scratch slot, which no real query reads
        if g.rows is not None:
            assert call.rows is not None
            g.rows[:B].copy_(call.rows)
            g.rows[B:].zero_()
        if g.idx is not None:
            assert call.logits_idx is not None
            g.idx[:B].copy_(call.logits_idx)
            g.idx[B:].zero_()

    @torch.no_grad()
    def _forward(self, g: _Static, cache: KVCache, key: GraphKey) -> ForwardOut:
        features = Features.SCORED if key.hidden else Features.NONE
        return self._model.run(ForwardCall(g.tokens, g.pos, cache, key.kv, g.rows, g.idx, key.n_layers, None, features))

    def _count_capture(self, seconds: float) -> None:
        self.stats.captures += 1
        self.stats.capture_seconds += seconds
        while len(self._graphs) > self.max_graphs:  # least recently used first
            self._graphs.popitem(last=False)
            self.stats.evictions += 1
        self.stats.graphs = len(self._graphs)

    def _capture(self, g: _Static, cache: KVCache, key: GraphKey) -> None:  # pragma: no cover - needs CUDA
        # the warm-up is idempotent: it rewrites the same cache slots with the same keys
        g.graph, g.out, dt = capture(lambda: self._forward(g, cache, key), self.device, self.pool)
        log.debug("captured CUDA graph %s in %.3f s", key, dt)
        self._count_capture(dt)


def cut_rows(out: Any, n: int) -> Any:
    """The first n rows of a graph's output (a tensor or a tuple of them), cloned: a later replay reuses
    the graph's output memory."""
    if isinstance(out, tuple):
        return tuple(o[:n].clone() for o in out)
    return out[:n].clone()


class GraphPool:  # pragma: no cover - needs CUDA
    """A CUDA graph memory pool that stays usable while anything holds it.

    PyTorch's allocator counts the live graphs of a pool and refuses (an internal assert) a capture into a
    pool whose count fell to zero but whose memory is not yet freed: what follows when a KV cache swap
    drops every graph. A one-kernel graph captured into the pool at creation, kept with it, holds the
    count above zero, so the wrappers sharing the pool can drop and recapture their graphs at any time.
    """

    def __init__(self, device: torch.device) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self._keeper = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.graph(self._keeper, pool=self.handle):
            self._buf = torch.zeros(1, device=device)


def capture(run: Any, device: torch.device, pool: GraphPool) -> tuple[Any, Any, float]:  # pragma: no cover - needs CUDA
    """(graph, its static output, seconds) of ``run()`` captured on ``device`` after a warm-up on a side stream
    (lazy inits: cuBLAS handles, rotary tables)."""
    t0 = time.perf_counter()
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool.handle, capture_error_mode="thread_local"):
            out = run()
        torch.cuda.synchronize()
    return graph, out, time.perf_counter() - t0


def graph_forwards(
    target: Transformer,
    draft: Transformer | None,
    k_max: int,
    batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
    *,
    emulate: bool = False,
) -> tuple[GraphedForward, GraphedForward | None]:
    """Graphed forwards for the target (verify widths up to k_max + 2; the early-exit drafter shares it,
    n_layers being in the key) and for a draft model (its steps and catch-up, T <= 2; None without one).
    The engine's builder hands them to the decode loop and the drafter in place of the models."""
    tg = GraphedForward(target, batch_buckets, max_tokens=k_max + 2, emulate=emulate)
    dg = None if draft is None else GraphedForward(draft, batch_buckets, max_tokens=2, emulate=emulate, pool=tg.pool)
    log.info("CUDA graphs on (batch buckets %s%s)", ",".join(map(str, tg.buckets)), ", emulated" if emulate else "")
    return tg, dg


def graph_stats(runners: Sequence[Any] | None) -> dict[str, Any] | None:
    """Totals over the wrappers for Engine.stats() (None: graphs off)."""
    if not runners:
        return None
    tot = GraphStats()
    for r in runners:
        for k, v in r.stats.to_dict().items():
            setattr(tot, k, getattr(tot, k) + v)
    out = tot.to_dict()
    out["capture_seconds"] = round(out["capture_seconds"], 4)
    out["emulated"] = runners[0].emulate
    out["batch_buckets"] = list(runners[0].buckets)
    return out
