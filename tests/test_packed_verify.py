"""The packed verify pass (engine/spec_decode/verify.py): decoding rows with different numbers of drafts run only
their real tokens, and score, write the cache and return features as the padded pass and the target alone do."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from util import PROMPTS

from engine import Engine
from engine.api.options import KernelOptions
from engine.core.forward import ForwardCall, KVCache
from engine.spec_decode.drafter import FeatureNeed
from engine.spec_decode.proposal import Proposal
from engine.spec_decode.verify import verify, verify_batch

ROWS = [2, 0, 1]  # cache rows of the batch's rows (not 0..B-1)
KS = [2, 0, 1]  # drafts per row: ragged, one row without any


def _round(model):
    """Three rows cached up to their last token, and a chain proposal of KS drafts (width 2)."""
    ctxs = [PROMPTS[0], PROMPTS[3][:9], PROMPTS[1][:5]]
    cache = KVCache(model.config, 3, 64, torch.float32, "cpu")
    with torch.no_grad():
        for ctx, row in zip(ctxs, ROWS):
            model.run(ForwardCall(torch.tensor([ctx[:-1]]), None, cache, len(ctx) - 1, torch.tensor([row])))
    drafts = torch.tensor([[7, 9], [0, 0], [11, 0]])
    prop = Proposal.chain(drafts, None, KS)
    return ctxs, cache, prop


def _step_target(ckpt_dir):
    from engine.kernels.cpu_gemm import small_gemm_status

    if small_gemm_status() is not None:
        pytest.skip(f"no CPU kernels: {small_gemm_status()}")
    return Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=True)).target


@pytest.mark.parametrize("prefill", [False, True], ids=["decoding", "a-prompt-joins"])
def test_a_packed_pass_scores_and_caches_as_the_padded_pass_and_the_target_alone(ckpt_dir, prefill):
    model = _step_target(ckpt_dir)
    ctxs, cache, prop = _round(model)
    tlens = [len(c) - 1 for c in ctxs]
    if prefill:  # row 1 (no drafts) has only 2 of its tokens cached: it prefills beside the others
        tlens[1] = 2
    vb = verify_batch(ctxs, tlens, prop, ROWS, 63, FeatureNeed.LAST)
    assert vb.packed and model.packs(cache)  # the step kernel, padding to drop
    padded_cache = KVCache(model.config, 3, 64, torch.float32, "cpu")
    padded_cache.k.copy_(cache.k)
    padded_cache.v.copy_(cache.v)
    with torch.no_grad():
        got = verify(model, cache, vb)
        want = verify(model, padded_cache, dataclasses.replace(vb, packed=False))
    assert got.logits.shape == want.logits.shape == (3, 3, model.config.vocab_size)
    assert got.features is not None and want.features is not None
    exact = {"rtol": 0, "atol": 0}  # the step computes each token alike in any call
    for b, (ctx, k, n) in enumerate(zip(ctxs, KS, tlens)):
        real = slice(0, k + 1)
        torch.testing.assert_close(got.logits[b, real], want.logits[b, real], **exact)
        torch.testing.assert_close(got.features[b, real], want.features[b, real], **exact)
        assert not got.logits[b, k + 1 :].any() and not got.features[b, k + 1 :].any()  # no token there: zeros
        drafts = prop.tokens[b, :k].tolist()
        with torch.no_grad():
            alone = model(torch.tensor([ctx + drafts]))[0, len(ctx) - 1 :]  # the target over context + drafts
        torch.testing.assert_close(got.logits[b, real], alone, rtol=1e-4, atol=1e-4)
        slots = slice(n, len(ctx) + k)  # the row's keys and values at its real tokens' slots: the padded pass's
        torch.testing.assert_close(cache.k[:, ROWS[b], :, slots], padded_cache.k[:, ROWS[b], :, slots], **exact)
        torch.testing.assert_close(cache.v[:, ROWS[b], :, slots], padded_cache.v[:, ROWS[b], :, slots], **exact)


def test_pytorchs_layers_keep_the_padded_pass(ckpt_dir):
    model = Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=False)).target
    ctxs, cache, prop = _round(model)
    assert not model.packs(cache)
    with pytest.raises(ValueError, match="step kernel only"):
        model.run(ForwardCall(prop.tokens, prop.tokens, cache, 40, torch.zeros_like(prop.tokens)))


def test_which_rounds_pack(ckpt_dir):
    model = Engine.from_pretrained(ckpt_dir).target
    ctxs, _, prop = _round(model)
    tlens = [len(c) - 1 for c in ctxs]
    assert verify_batch(ctxs, tlens, prop, ROWS, 63, FeatureNeed.NONE).packed
    even = Proposal.chain(torch.tensor([[7, 9], [3, 4], [11, 5]]), None, [2, 2, 2])
    assert not verify_batch(ctxs, tlens, even, ROWS, 63, FeatureNeed.NONE).packed  # no padding to drop
    joins = [len(ctxs[0]) - 1, 2, len(ctxs[2]) - 1]  # a row with uncached prompt tokens
    assert verify_batch(ctxs, joins, prop, ROWS, 63, FeatureNeed.LAST).packed
    assert not verify_batch(ctxs, joins, prop, ROWS, 63, FeatureNeed.ALL).packed  # every prompt position's features
    meta = Proposal.chain(prop.tokens.to("meta"), None, KS)  # another device: the padded pass
    assert not verify_batch(ctxs, tlens, meta, ROWS, 63, FeatureNeed.NONE).packed
