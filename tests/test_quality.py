"""engine.build.quality: windows, PPL against transformers, KL divergence, the drift interval, WikiText-2."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import Engine
from engine.api.options import PrecisionConfig
from engine.build.quality import (
    EvalTextError,
    QualityReport,
    compare_models,
    default_context,
    drift_interval,
    eval_windows,
    load_eval_ids,
    perplexity,
    t_quantile_975,
    text_sha256,
)
from engine.core.errors import EngineError, InvalidRequestError

WIKI = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"


@pytest.fixture(scope="module")
def short_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama whose max_position_embeddings (96) is below the default context of 512."""
    from util import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("short"), "llama", max_position_embeddings=96)


@pytest.fixture(scope="module")
def text_ids(ckpt_dir: Path) -> list[int]:
    from util import TEXT

    ids = load_eval_ids(Engine.from_pretrained(ckpt_dir).tokenizer, TEXT * 8)
    assert len(ids) > 1000
    return ids


# ------------------------------------------------------------------------------------------ windows
@pytest.mark.parametrize(
    "n,ctx",
    [
        (2, 512),
        (100, 512),
        (512, 512),
        (513, 512),
        (1000, 512),
        (5000, 512),
        (7, 3),
        (10, 2),
        (101, 10),
        (300, 255),
        (1025, 256),
    ],
)
def test_every_token_after_the_first_scored_once(n: int, ctx: int) -> None:
    wins = eval_windows(n, ctx)
    scored = np.zeros(n, dtype=int)
    h = ctx // 2
    for k, (start, end, score_from) in enumerate(wins):
        assert start == k * h and end - start <= ctx and end <= n
        assert start + 1 <= score_from < end
        if k:  # the second half of the window: at least h tokens of context before each scored token
            assert score_from - start >= h
        scored[score_from:end] += 1
    assert scored[0] == 0 and (scored[1:] == 1).all()
    if n <= ctx:
        assert wins == [(0, n, 1)]


def test_windows_exact_rule() -> None:
    assert eval_windows(1000, 512) == [(0, 512, 1), (256, 768, 512), (512, 1000, 768)]
    assert eval_windows(7, 3) == [(0, 3, 1), (1, 4, 3), (2, 5, 4), (3, 6, 5), (4, 7, 6)]
    assert default_context(96) == 96 and default_context(4096) == 512 and default_context(4096, 256) == 256


@pytest.mark.parametrize("n,ctx", [(1, 512), (0, 8), (10, 1), (10, 0), (2.5, 8), (10, None)])
def test_windows_refuse_bad_sizes(n, ctx) -> None:
    with pytest.raises(InvalidRequestError, match="n_tokens|context"):
        eval_windows(n, ctx)


# ---------------------------------------------------------------------- PPL against transformers
def _hf_strided_ppl(model, ids: list[int], ctx: int) -> tuple[float, float, int]:
    """HF's documented strided-perplexity recipe with our own NLL sums: (ppl, llama.cpp err, tokens)."""
    x = torch.tensor([ids])
    n, stride, prev_end, nlls = len(ids), ctx // 2, 0, []
    for begin in range(0, n, stride):
        end = min(begin + ctx, n)
        trg_len = end - prev_end
        with torch.no_grad():
            logits = model(x[:, begin:end]).logits[0].double()
        lp = logits[:-1] - torch.logsumexp(logits[:-1], dim=-1, keepdim=True)
        nll = -lp[torch.arange(end - begin - 1), x[0, begin + 1 : end]]
        nlls.append(nll[-min(trg_len, end - begin - 1) :])
        prev_end = end
        if end == n:
            break
    nll = torch.cat(nlls)
    ppl = math.exp(nll.mean().item())
    var = (nll**2).mean().item() - nll.mean().item() ** 2
    return ppl, ppl * math.sqrt(var / (nll.numel() - 1)), nll.numel()


def test_ppl_matches_transformers_with_model_max_context(short_ckpt: Path) -> None:
    import transformers as tf
    from util import TEXT

    eng = Engine.from_pretrained(short_ckpt)
    ids = load_eval_ids(eng.tokenizer, TEXT * 3)
    ctx = default_context(eng.config.max_position_embeddings)
    assert ctx == 96 and len(ids) > 3 * ctx
    hf = tf.LlamaForCausalLM.from_pretrained(short_ckpt, dtype=torch.float32).eval()
    want, want_err, n = _hf_strided_ppl(hf, ids, ctx)
    assert n == len(ids) - 1
    got, err = perplexity(eng.logits, ids, ctx)
    assert got == pytest.approx(want, rel=1e-4)
    assert err == pytest.approx(want_err, rel=1e-3)
    with pytest.raises(InvalidRequestError):  # the engine refuses windows beyond the model's maximum
        perplexity(eng.logits, ids, 128)


# ---------------------------------------------------------------------------- compare_models
def test_identical_models_have_zero_drift_and_kld(ckpt_dir: Path, text_ids: list[int]) -> None:
    eng = Engine.from_pretrained(ckpt_dir)
    r = compare_models(eng.logits, eng.logits, text_ids, 128, max_tokens=700)
    assert r.tokens == 699 and r.windows == len(eval_windows(700, 128))
    assert r.drift == 0.0 and r.drift_ci95 == (0.0, 0.0) and r.kld_mean == 0.0 and r.kld_p99 == 0.0
    assert r.top1 == 1.0 and r.ppl == r.ppl_ref and r.ppl_err == r.ppl_ref_err
    assert r.passes(0.0, 0.0)
    assert (r.ppl, r.ppl_err) == pytest.approx(perplexity(eng.logits, text_ids, 128, max_tokens=700), rel=1e-12)


def test_perturbed_copy_kld_matches_independent_computation(
    ckpt_dir: Path, text_ids: list[int], tmp_path: Path
) -> None:
    from scipy.special import rel_entr
    from util import make_checkpoint

    other = make_checkpoint(tmp_path / "pert", "llama", num_hidden_layers=4, perturb=0.02)
    a = Engine.from_pretrained(ckpt_dir)
    b = Engine.from_pretrained(other)
    ids, ctx = text_ids[:900], 128
    r = compare_models(a.logits, b.logits, ids, ctx)
    # independent: scipy's rel_entr on float64 softmaxes, tokens gathered per window by hand
    kl, agree, nll_a, nll_b = [], [], [], []
    for start, end, sf in eval_windows(len(ids), ctx):
        x = torch.tensor([ids[start:end]])
        la, lb = (m.target(x)[0].double() for m in (a, b))
        pa, pb = torch.softmax(la, -1).numpy(), torch.softmax(lb, -1).numpy()
        rows = np.arange(sf - 1 - start, end - 1 - start)
        kl += rel_entr(pa[rows], pb[rows]).sum(-1).tolist()
        agree += (pa[rows].argmax(-1) == pb[rows].argmax(-1)).tolist()
        tgt = np.array(ids[sf:end])
        nll_a += (-np.log(pa[rows, tgt])).tolist()
        nll_b += (-np.log(pb[rows, tgt])).tolist()
    kl = np.array(kl)
    assert r.tokens == len(kl) == len(ids) - 1
    assert r.kld_mean > 0 and r.kld_mean == pytest.approx(kl.mean(), rel=1e-3, abs=1e-7)
    assert r.kld_p99 == pytest.approx(np.percentile(kl, 99), rel=1e-3, abs=1e-7)
    assert r.top1 == pytest.approx(np.mean(agree), abs=1e-12) and r.top1 < 1.0
    assert r.ppl_ref == pytest.approx(math.exp(np.mean(nll_a)), rel=1e-5)
    assert r.ppl == pytest.approx(math.exp(np.mean(nll_b)), rel=1e-5)
    assert r.drift == pytest.approx(r.ppl - r.ppl_ref, abs=1e-12)
    lo, hi = r.drift_ci95
    assert lo < r.drift < hi and r.method == "windows"
    assert r.passes(abs(r.drift), r.kld_mean) and not r.passes(abs(r.drift) * 0.99, 1.0)
    assert not r.passes(1e9, r.kld_mean * 0.99)
    d = r.to_dict()
    assert (
        d["drift_ci95"] == [lo, hi]
        and d["kld_mean"] == r.kld_mean
        and set(d) >= {"ppl_ref", "ppl", "drift", "ppl_ref_err", "ppl_err", "kld_p99", "top1", "tokens", "windows"}
    )


def test_planned_engine_against_its_unquantized_self(ckpt_dir: Path, text_ids: list[int]) -> None:
    from util import TEXT

    from quant import lookup_gpu, make_plan

    ref = Engine.from_pretrained(ckpt_dir)
    plan = make_plan(lookup_gpu("a100"), ref.config, None, device="cpu")
    assert plan.target.families["ffn"].storage == "int8"
    planned = Engine.from_pretrained(ckpt_dir, precision=PrecisionConfig(plan, TEXT))
    r = compare_models(ref.logits, planned.logits, text_ids, 128, max_tokens=800)
    figures = [r.ppl_ref, r.ppl, r.drift, *r.drift_ci95, r.ppl_err, r.kld_mean, r.kld_p99, r.top1]
    assert all(math.isfinite(f) for f in figures)
    assert 0 < r.kld_mean < 1e-2 and r.top1 > 0.9 and abs(r.drift) < 0.02 * r.ppl_ref


def test_logits_fn_shape_and_vocab_are_checked(text_ids: list[int]) -> None:
    good = lambda x: torch.zeros(*x.shape, 10)  # noqa: E731
    with pytest.raises(InvalidRequestError, match="ids contains token"):
        perplexity(good, text_ids, 16, max_tokens=40)
    text_ids = [i % 10 for i in text_ids]
    with pytest.raises(InvalidRequestError, match="test_logits returned"):
        compare_models(good, lambda x: torch.zeros(1, x.shape[1], 11), text_ids, 16, max_tokens=40)
    with pytest.raises(InvalidRequestError, match="logits_fn returned"):
        perplexity(lambda x: torch.zeros(x.shape[1], 10), text_ids, 16, max_tokens=40)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        perplexity(good, text_ids, 16, max_tokens=1)
    # uniform logits: PPL is exactly the vocabulary size, with zero spread
    assert perplexity(good, text_ids, 16, max_tokens=40) == pytest.approx((10.0, 0.0))


# ------------------------------------------------------------------------------- the interval
def test_t_quantile_matches_scipy() -> None:
    from scipy.stats import t

    for dof in [*range(1, 40), 50, 77, 200, 10_000]:
        assert t_quantile_975(dof) == pytest.approx(t.ppf(0.975, dof), abs=2e-4)


def test_drift_interval_equal_windows_and_coverage() -> None:
    rng = np.random.default_rng(0)
    # equal windows: the cluster-robust se is the plain standard error of the per-window means
    counts = np.full(12, 50)
    diff = rng.normal(0.01, 0.05, 600) + np.repeat(rng.normal(0, 0.02, 12), 50)
    (lo, hi), unit = drift_interval(10.0, diff, counts)
    dw = diff.reshape(12, 50).mean(1)
    half = t_quantile_975(11) * dw.std(ddof=1) / math.sqrt(12)
    assert unit == "windows"
    assert lo == pytest.approx(10 * math.expm1(diff.mean() - half)) and hi == pytest.approx(
        10 * math.expm1(diff.mean() + half)
    )
    # coverage: windows share a random effect (tokens within a window are correlated); the true dPPL is
    # ppl_ref * (exp(mu) - 1). A per-token interval would undercover badly here; ours covers ~95%.
    mu, hits, naive_hits, trials = 0.02, 0, 0, 400
    counts = rng.integers(40, 80, 20)
    for _ in range(trials):
        diff = np.repeat(rng.normal(0, 0.03, 20), counts) + rng.normal(0, 0.05, counts.sum()) + mu
        (lo, hi), _ = drift_interval(10.0, diff, counts)
        hits += lo <= 10 * math.expm1(mu) <= hi
        se = diff.std(ddof=1) / math.sqrt(diff.size)
        naive_hits += abs(diff.mean() - mu) <= 1.96 * se
    assert 0.90 <= hits / trials <= 0.99
    assert naive_hits / trials < 0.75
    (lo, hi), unit = drift_interval(10.0, rng.normal(0, 0.1, 30), np.array([30]))
    assert unit == "tokens" and lo < 0 < hi


# ------------------------------------------------------------------------------------ eval text
def test_load_eval_ids_and_sha(tmp_path: Path, ckpt_dir: Path) -> None:
    import hashlib

    tok = Engine.from_pretrained(ckpt_dir).tokenizer
    text = "hello world\nthe quick brown fox\n"
    f = tmp_path / "e.txt"
    f.write_text(text, encoding="utf-8")
    assert load_eval_ids(tok, f) == load_eval_ids(tok, str(f)) == load_eval_ids(tok, text) == tok.encode(text)
    assert load_eval_ids(tok, f, max_tokens=5) == tok.encode(text)[:5]
    assert text_sha256(text) == hashlib.sha256(text.encode()).hexdigest()
    missing = tmp_path / "nope.txt"
    with pytest.raises(EvalTextError, match="nope.txt") as e:
        load_eval_ids(tok, missing)
    assert isinstance(e.value, EngineError)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa not utf8")
    with pytest.raises(EvalTextError, match="bad.txt.*UTF-8"):
        load_eval_ids(tok, tmp_path / "bad.txt")
    with pytest.raises(EvalTextError, match="tmp|directory|read"):
        load_eval_ids(tok, tmp_path)
    with pytest.raises(EvalTextError, match="at least 2"):
        load_eval_ids(tok, "\n", max_tokens=None)


@pytest.mark.skipif(not WIKI.is_file(), reason=f"WikiText-2 test split not found at {WIKI}")
def test_wikitext2_first_20k_tokens(ckpt_dir: Path, tmp_path: Path) -> None:
    from util import make_checkpoint

    ref = Engine.from_pretrained(ckpt_dir)
    ids = load_eval_ids(ref.tokenizer, WIKI, max_tokens=20_000)
    assert len(ids) == 20_000
    test = Engine.from_pretrained(make_checkpoint(tmp_path / "p", "llama", num_hidden_layers=4, perturb=0.01))
    ctx = default_context(ref.config.max_position_embeddings)
    r = compare_models(ref.logits, test.logits, ids, ctx)
    assert isinstance(r, QualityReport) and ctx == 512 and r.tokens == 19_999 and r.windows == 78
    assert all(math.isfinite(v) for v in (r.ppl_ref, r.ppl, r.drift, *r.drift_ci95, r.kld_mean, r.kld_p99))
    assert r.ppl_ref > 1 and r.kld_mean > 0 and 0 < r.top1 <= 1
