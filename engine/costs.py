"""Measuring the cost ratios the K controller needs: c = draft step / target step and
v(K) = verify pass of K+1 tokens / target step, on the device at hand."""
from __future__ import annotations

import time
from typing import Callable

import torch

from .adaptive import Costs
from .model import KVCache, Transformer


def _best_time(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed run: robust to other load on the machine


@torch.no_grad()
def step_time(model: Transformer, n_tokens: int, *, context: int = 64, batch: int = 1,
              n_layers: int | None = None, reps: int = 5) -> float:
    """Best-of-reps seconds of one cached forward of n_tokens per row after `context` cached tokens."""
    w = model.norm.weight
    dev = w.device
    cache = KVCache(model.config, batch, context + n_tokens + 1, w.dtype, dev)
    toks = torch.randint(0, model.config.vocab_size, (batch, n_tokens), device=dev)
    pos = (context + torch.arange(n_tokens, device=dev)).expand(batch, n_tokens)
    idx = torch.full((batch, n_tokens), 0, device=dev) + torch.arange(n_tokens, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    # every row at the same length: the aligned path (slice writes, no mask), as the loop runs a batch of one
    return _best_time(lambda: model(toks, pos, cache, context + n_tokens, None, logits_idx=idx,
                                      n_layers=n_layers, start=context), reps, sync)


def measure_costs(target: Transformer, draft: Transformer | None, *, k_max: int = 8,
                  draft_layers: int | None = None, batch: int = 1, reps: int = 5) -> Costs:
    """c and v(K) for K in 1..k_max. ``draft`` None with draft_layers: early exit; both None: n-gram (c = 0)."""
    t1 = step_time(target, 1, batch=batch, reps=reps)
    v: dict[int, float] = {}
    for k in range(1, k_max + 1):
        # a verify of more tokens never costs less: a dip is timing noise, and a noisy low v(K) would
        # lure the controller to a long K (a running max keeps the measured curve monotone)
        v[k] = max(step_time(target, k + 1, batch=batch, reps=reps) / t1, v.get(k - 1, 0.0))
    if draft is not None:
        c = step_time(draft, 1, batch=batch, reps=reps) / t1
    elif draft_layers is not None:
        c = step_time(target, 1, batch=batch, n_layers=draft_layers, reps=reps) / t1
    else:
        c = 0.0
    return Costs(c=c, v=v)
