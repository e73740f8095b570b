"""The quality gate's figures: perplexity, KL divergence and top-1 agreement in fixed windows.

Both models see exactly the same windows of the same token ids (see ``eval_windows``);
logits are turned into fp32 log-probabilities, per scored token we keep the negative
log-likelihood (NLL) of the true next token under each model, KL(P_ref || P_test) and
whether the two argmaxes agree. Sums are accumulated in float64.

Error bars (``QualityReport``):

* ``ppl_err`` / ``ppl_ref_err``: llama.cpp's perplexity tool rule,
  ``PPL * sqrt(var(nll) / (N - 1))`` with the population variance of the per-token NLLs.
* ``drift_ci95``: a 95% interval for dPPL = PPL - PPL_ref from the per-window
  differences. Let ``d_w`` be window w's mean over its ``n_w`` scored tokens of
  ``nll_test - nll_ref`` and ``D = sum_w n_w d_w / N`` (= ln(PPL / PPL_ref) exactly).
  Windows are the independent units (a cluster-robust / ratio-estimator variance):
  ``se(D)^2 = W / (W - 1) * sum_w n_w^2 (d_w - D)^2 / N^2``, which is ``var(d_w) / W`` when all
  windows score the same number of tokens. The interval ``D +- t_{0.975, W-1} se(D)`` on the
  log-ratio is mapped through ``PPL_ref * (exp(.) - 1)``: it is asymmetric, contains 0 exactly
  when the log-ratio interval does, and treats PPL_ref as fixed (its own sampling error only
  enters at second order in D). With a single window the per-token differences are the units
  instead (``method`` says which was used).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from engine.api.profile_quality import QualityFigures
from engine.core.errors import EngineError, InvalidRequestError

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 512
LogitsFn = Callable[[Tensor], Tensor]


class EvalTextError(EngineError, ValueError):
    """The evaluation text is missing, unreadable, not UTF-8 or too short."""


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def default_context(max_position_embeddings: int, context: int = DEFAULT_CONTEXT) -> int:
    """The window length: ``context`` (512 by default), or the model's maximum if smaller."""
    return min(int(context), int(max_position_embeddings))


def eval_windows(n_tokens: int, context: int) -> list[tuple[int, int, int]]:
    """Fixed evaluation windows ``(start, end, score_from)``, llama.cpp style.

    Rule: stride ``h = context // 2``; window k feeds ids[start:end] with ``start = k * h``
    and ``end = min(start + context, n_tokens)``; it scores the targets ids[t] for
    ``score_from <= t < end`` (token t predicted by the logits at position ``t - 1 - start``),
    where ``score_from = 1`` for the first window (scored whole; token 0 has no context) and
    the previous window's end otherwise, which is ``start + context - h`` (the second half of
    the window) for a full window. Windows stop at the first one that reaches ``n_tokens``, so
    every token after the first is scored exactly once and each scored token after the first
    window sees at least ``h`` tokens of context. ``n_tokens <= context`` gives one window.
    """
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 2:
        raise InvalidRequestError(f"n_tokens={n_tokens!r} is invalid: allowed an int >= 2 (one token to score)")
    if not isinstance(context, int) or isinstance(context, bool) or context < 2:
        raise InvalidRequestError(f"context={context!r} is invalid: allowed an int >= 2")
    h = context // 2
    out: list[tuple[int, int, int]] = []
    start, scored_to = 0, 1
    while scored_to < n_tokens:
        end = min(start + context, n_tokens)
        out.append((start, end, scored_to))
        scored_to = end
        start += h
    return out


@dataclass(frozen=True)
class QualityReport(QualityFigures):
    """Figures of a test model against a reference on the same windows (see the module doc); a profile keeps
    the passing plan's as its ``quality`` (``QualityFigures``, engine/api/profile_quality.py)."""

    def passes(self, max_drift: float, max_kld: float) -> bool:
        """|drift| <= max_drift and kld_mean <= max_kld (False when a figure is NaN)."""
        return bool(abs(self.drift) <= max_drift and self.kld_mean <= max_kld)


_T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157)


def t_quantile_975(dof: int) -> float:
    """Student-t 0.975 quantile: a table for dof < 10, else the Cornish-Fisher expansion (error < 2e-4)."""
    if dof <= 0:
        return math.inf
    if dof < 10:
        return _T975[dof - 1]
    z, n = 1.959963984540054, float(dof)
    return (
        z
        + (z**3 + z) / (4 * n)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * n**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * n**3)
    )


def _check_max_tokens(max_tokens: object) -> None:
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 2):
        raise InvalidRequestError(f"max_tokens={max_tokens!r} is invalid: allowed an int >= 2 or None")


def text_sha256(text: str) -> str:
    """Hex sha256 of the UTF-8 bytes of ``text`` (the profile's ``eval_text_sha256``)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_eval_text(path: str | os.PathLike[str]) -> str:
    """The text of an eval file (UTF-8); EvalTextError naming the path when it cannot be read."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EvalTextError(f"eval text {str(p)!r}: file not found") from None
    except UnicodeDecodeError as e:
        raise EvalTextError(f"eval text {str(p)!r}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise EvalTextError(f"eval text {str(p)!r}: cannot be read ({e.strerror or e})") from None


def load_eval_ids(
    tokenizer: _Encoder, path_or_text: str | os.PathLike[str], max_tokens: int | None = None
) -> list[int]:
    """Token ids of the eval text, the first ``max_tokens`` of them when given.

    A ``Path`` (any os.PathLike) or a ``str`` without a newline is a file path (read as UTF-8;
    a missing or unreadable file raises EvalTextError naming it); a ``str`` with a newline is
    the text itself. Fewer than 2 tokens raise EvalTextError.
    """
    _check_max_tokens(max_tokens)
    if isinstance(path_or_text, str) and "\n" in path_or_text:
        text, where = path_or_text, "eval text"
    elif isinstance(path_or_text, (str, os.PathLike)):
        text, where = read_eval_text(path_or_text), f"eval text {str(path_or_text)!r}"
    else:
        raise InvalidRequestError(f"path_or_text={type(path_or_text).__name__} is invalid: allowed a path or text")
    ids = list(tokenizer.encode(text))
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise EvalTextError(f"{where}: {len(ids)} token(s), allowed at least 2")
    return ids


# ---------------------------------------------------------------------------- shared window loop
def _logprobs(fn: LogitsFn, name: str, x: Tensor, vocab: int | None, lo: int, hi: int) -> Tensor:
    """fp32 log-probs [hi - lo, V] of the logit positions lo..hi-1 of fn(x)."""
    out = fn(x)
    if not isinstance(out, Tensor) or out.dim() != 3 or out.shape[:2] != x.shape:
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise InvalidRequestError(f"{name} returned {shape} for input {tuple(x.shape)}: allowed [1, T, V] logits")
    if vocab is not None and out.shape[-1] != vocab:
        raise InvalidRequestError(f"{name} returned vocab {out.shape[-1]}, the reference has {vocab}: allowed equal")
    return F.log_softmax(out[0, lo:hi].detach().float(), dim=-1).cpu()  # on the model's device, then the host


def _window_logprobs(
    fns: Sequence[tuple[str, LogitsFn]], ids: Sequence[int], context: int, max_tokens: int | None, progress: bool
) -> Iterator[tuple[Tensor, list[Tensor]]]:
    """Per window: (targets [S], [log-probs [S, V] per fn]) over the window's scored tokens."""
    _check_max_tokens(max_tokens)
    all_ids = torch.as_tensor(list(ids)[:max_tokens] if max_tokens else list(ids), dtype=torch.long)
    if all_ids.dim() != 1:
        raise InvalidRequestError(f"ids has shape {tuple(all_ids.shape)}: allowed a flat list of token ids")
    wins = eval_windows(int(all_ids.numel()), context)
    log.debug("%d windows of <= %d tokens over %d tokens", len(wins), context, all_ids.numel())
    with torch.inference_mode():
        for start, end, score_from in tqdm(wins, desc="perplexity", unit="win", disable=not progress):
            x = all_ids[start:end].unsqueeze(0)
            lo, hi = score_from - 1 - start, end - 1 - start  # logit positions predicting the scored targets
            lps: list[Tensor] = []
            vocab: int | None = None
            for name, fn in fns:
                lps.append(_logprobs(fn, name, x, vocab, lo, hi))
                vocab = lps[-1].shape[-1]
            if start == 0:  # the vocabulary is known from the first window: check every id once
                bad = all_ids[(all_ids < 0) | (all_ids >= vocab)]
                if bad.numel():
                    raise InvalidRequestError(
                        f"ids contains token {int(bad[0])}: allowed 0..{vocab - 1} (the logits' vocabulary)"
                    )
            yield all_ids[score_from:end], lps


def _ppl_err(nll: np.ndarray) -> tuple[float, float]:
    """(PPL, llama.cpp's +- error) from per-token NLLs."""
    n = nll.size
    mean = float(nll.mean(dtype=np.float64))
    ppl = math.exp(mean)
    var = float(np.mean(nll.astype(np.float64) ** 2) - mean**2)
    err = ppl * math.sqrt(var / (n - 1)) if n > 1 and var > 0 else 0.0
    return ppl, err


def _mean_err(x: np.ndarray) -> tuple[float, float]:
    x = x.astype(np.float64)
    n = x.size
    return float(x.mean()), (float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0)


def drift_interval(ppl_ref: float, diff: np.ndarray, counts: np.ndarray) -> tuple[tuple[float, float], str]:
    """95% interval for dPPL from per-token NLL differences ``diff`` grouped in windows of ``counts``.

    See the module doc; returns ((low, high), unit) with unit "windows" or "tokens".
    """
    diff = diff.astype(np.float64)
    n = diff.size
    d_total = float(diff.mean())
    if counts.size >= 2:
        sums = np.add.reduceat(diff, np.concatenate([[0], np.cumsum(counts)[:-1]]))
        resid = sums - counts * d_total  # n_w (d_w - D)
        w = counts.size
        se = math.sqrt(w / (w - 1) * float(np.sum(resid**2))) / n
        q, unit = t_quantile_975(w - 1), "windows"
    else:
        se = float(diff.std(ddof=1)) / math.sqrt(n) if n > 1 else math.inf
        q, unit = t_quantile_975(n - 1), "tokens"
    lo, hi = d_total - q * se, d_total + q * se
    return (ppl_ref * math.expm1(lo), ppl_ref * math.expm1(hi)), unit


def perplexity(
    logits_fn: LogitsFn, ids: Sequence[int], context: int, *, max_tokens: int | None = None, progress: bool = False
) -> tuple[float, float]:
    """(PPL, +- error) of one model on the windows of ``eval_windows(len(ids), context)``."""
    nlls = []
    for tgt, (lp,) in _window_logprobs([("logits_fn", logits_fn)], ids, context, max_tokens, progress):
        nlls.append(-lp.gather(1, tgt[:, None])[:, 0].double().numpy())
    return _ppl_err(np.concatenate(nlls))


def compare_models(
    ref_logits: LogitsFn,
    test_logits: LogitsFn,
    ids: Sequence[int],
    context: int,
    *,
    max_tokens: int | None = None,
    progress: bool = False,
) -> QualityReport:
    """Figures of ``test_logits`` against ``ref_logits`` on the same windows (see the module doc).

    Each callable maps token ids [1, T] to logits [1, T, V]; both must share V.
    """
    nll_r, nll_t, kld, agree, counts = [], [], [], [], []
    for tgt, (lr, lt) in _window_logprobs(
        [("ref_logits", ref_logits), ("test_logits", test_logits)], ids, context, max_tokens, progress
    ):
        nll_r.append(-lr.gather(1, tgt[:, None])[:, 0].double().numpy())
        nll_t.append(-lt.gather(1, tgt[:, None])[:, 0].double().numpy())
        kld.append((lr.exp() * (lr - lt)).sum(-1).double().numpy())
        agree.append((lr.argmax(-1) == lt.argmax(-1)).double().numpy())
        counts.append(tgt.numel())
    r, t, k, a = (np.concatenate(v) for v in (nll_r, nll_t, kld, agree))
    cnt = np.asarray(counts, dtype=np.int64)
    ppl_ref, ppl_ref_err = _ppl_err(r)
    ppl, ppl_err = _ppl_err(t)
    ci, unit = drift_interval(ppl_ref, t - r, cnt)
    kld_mean, kld_err = _mean_err(k)
    top1, top1_err = _mean_err(a)
    rep = QualityReport(
        ppl_ref=ppl_ref,
        ppl=ppl,
        drift=ppl - ppl_ref,
        drift_ci95=ci,
        ppl_ref_err=ppl_ref_err,
        ppl_err=ppl_err,
        kld_mean=kld_mean,
        kld_err=kld_err,
        kld_p99=float(np.percentile(k, 99)),
        top1=top1,
        top1_err=top1_err,
        tokens=int(r.size),
        windows=int(cnt.size),
        context=int(context),
        method=unit,
    )
    log.info(
        "PPL ref %.4f, test %.4f, dPPL %+.4f [%+.4f, %+.4f], KLD %.5f (p99 %.5f), top-1 %.4f on %d tokens",
        ppl_ref,
        ppl,
        rep.drift,
        ci[0],
        ci[1],
        kld_mean,
        rep.kld_p99,
        top1,
        rep.tokens,
    )
    return rep
