"""Measuring the cost ratios the K controller needs: c = draft step / target step and
v(K) = verify pass of K+1 tokens / target step, on the device at hand.

A round's first draft step runs right after the previous verify pass has streamed the
target's weights through the caches, so it costs more than the K - 1 steps after it
(docs/performance.md has the measured ratio). The cost model prices K draft steps at
K * c; the first step's extra is a per-round cost like the verify pass, so c is the warm
step and the extra is added to every v(K): c_cold + (K-1) c_warm + verify = K c + v(K).

Each repeat times every forward once (target step, draft step, verify of 2..k_max+1
tokens) and forms the ratios within that repeat; the result is the median over
repeats. Ratios taken side by side cancel the slow drifts of a shared machine, and a
median ignores the odd disturbed repeat in either direction (a minimum of separately
timed runs does not: one lucky draft run made c look half its size).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.core.model import KVCache, Transformer
from engine.spec_decode.adaptive import Costs

if TYPE_CHECKING:
    from engine.spec_decode.drafter import Drafter


def cached_forward(
    model: Transformer, n_tokens: int, *, context: int = 64, batch: int = 1, n_layers: int | None = None
) -> Callable[[], object]:
    """One cached forward of n_tokens per row after ``context`` cached tokens, every row at the same
    length: the aligned path (slice writes, no mask) the loop runs for a batch of one."""
    w = model.norm.weight
    dev = w.device
    cache = KVCache(model.config, batch, context + n_tokens + 1, w.dtype, dev)
    toks = torch.randint(0, model.config.vocab_size, (batch, n_tokens), device=dev)
    pos = (context + torch.arange(n_tokens, device=dev)).expand(batch, n_tokens)
    idx = torch.arange(n_tokens, device=dev).expand(batch, n_tokens)
    return lambda: model(toks, pos, cache, context + n_tokens, None, idx, n_layers, context)


@torch.no_grad()
def measure_costs(
    target: Transformer,
    draft_step: Callable[[], object] | None,
    *,
    k_max: int = 8,
    batch: int = 1,
    reps: int = 7,
) -> Costs:
    """c and v(K) for K in 1..k_max. ``draft_step``: one draft step (``Drafter.cost_step``); None: drafting
    costs nothing measurable (n-gram, c = 0)."""
    dev = target.norm.weight.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    step = cached_forward(target, 1, batch=batch)
    verify = {k: cached_forward(target, k + 1, batch=batch) for k in range(1, k_max + 1)}

    def timed(fn: Callable[[], object]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    for fn in [step, *verify.values()] + ([draft_step] if draft_step is not None else []):  # warm-up
        fn()
    cs, cold, vs = [], [], {k: [] for k in verify}
    for _ in range(reps):
        t1 = timed(step)
        for k, fn in verify.items():
            vs[k].append(timed(fn) / t1)
        if draft_step is not None:  # after the largest verify, as in a round: a cold step, then a warm one
            first = timed(draft_step)
            cs.append(timed(draft_step) / t1)
            cold.append(first / t1)
    extra = max(0.0, statistics.median(cold) - statistics.median(cs)) if cs else 0.0
    v: dict[int, float] = {}
    for k in sorted(vs):
        # a verify of more tokens never costs less: a dip is timing noise, and a noisy low v(K) would
        # lure the controller to a long K (a running max keeps the measured curve monotone)
        v[k] = max(statistics.median(vs[k]) + extra, v.get(k - 1, 0.0))
    return Costs(c=statistics.median(cs) if cs else 0.0, v=v)


def drafter_costs(target: Transformer, drafter: Drafter, k_max: int, batch: int = 1, reps: int = 7) -> Costs:
    """``measure_costs`` for the engine's drafter at ``batch`` sequences (its ``cost_step``)."""
    return measure_costs(target, drafter.cost_step(batch), k_max=k_max, batch=batch, reps=reps)
