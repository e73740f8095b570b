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


@pytest.mark.parametrize("kernel", [False, True], ids=["pytorch", "cpu-step"])
def test_a_packed_pass_scores_and_caches_as_the_padded_pass_and_the_target_alone(ckpt_dir, kernel):
    from engine.kernels.cpu_gemm import small_gemm_status

    if kernel and small_gemm_status() is not None:
        pytest.skip(f"no CPU kernels: {small_gemm_status()}")
    model = Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=kernel)).target
    assert (model.layer_step is not None) == kernel
    ctxs, cache, prop = _round(model)
    vb = verify_batch(ctxs, [len(c) - 1 for c in ctxs], prop, ROWS, 63, FeatureNeed.LAST)
    assert vb.packed  # decoding rows on the CPU, ragged drafts
    padded_cache = KVCache(model.config, 3, 64, torch.float32, "cpu")
    padded_cache.k.copy_(cache.k)
    padded_cache.v.copy_(cache.v)
    with torch.no_grad():
        got = verify(model, cache, vb)
        want = verify(model, padded_cache, dataclasses.replace(vb, packed=False))
    assert got.logits.shape == want.logits.shape == (3, 3, model.config.vocab_size)
    assert got.features is not None and want.features is not None
    for b, (ctx, k) in enumerate(zip(ctxs, KS)):
        real = slice(0, k + 1)
        exact = {"rtol": 0, "atol": 0} if kernel else {"rtol": 1e-5, "atol": 1e-5}  # the step: rows independent
        torch.testing.assert_close(got.logits[b, real], want.logits[b, real], **exact)
        torch.testing.assert_close(got.features[b, real], want.features[b, real], **exact)
        assert not got.logits[b, k + 1 :].any() and not got.features[b, k + 1 :].any()  # no token there: zeros
        drafts = prop.tokens[b, :k].tolist()
        with torch.no_grad():
            alone = model(torch.tensor([ctx + drafts]))[0, len(ctx) - 1 :]  # the target over context + drafts
        torch.testing.assert_close(got.logits[b, real], alone, rtol=1e-4, atol=1e-4)
        n = len(ctx) - 1  # the row's keys and values at its real tokens' slots: the padded pass's
        slots = slice(n, n + k + 1)
        torch.testing.assert_close(cache.k[:, ROWS[b], :, slots], padded_cache.k[:, ROWS[b], :, slots], **exact)
        torch.testing.assert_close(cache.v[:, ROWS[b], :, slots], padded_cache.v[:, ROWS[b], :, slots], **exact)


def test_only_ragged_decoding_rounds_on_the_cpu_pack(ckpt_dir):
    model = Engine.from_pretrained(ckpt_dir).target
    ctxs, _, prop = _round(model)
    tlens = [len(c) - 1 for c in ctxs]
    assert verify_batch(ctxs, tlens, prop, ROWS, 63, FeatureNeed.NONE).packed
    even = Proposal.chain(torch.tensor([[7, 9], [3, 4], [11, 5]]), None, [2, 2, 2])
    assert not verify_batch(ctxs, tlens, even, ROWS, 63, FeatureNeed.NONE).packed  # no padding to drop
    prefill = [len(ctxs[0]) - 1, 2, len(ctxs[2]) - 1]  # a row with uncached prompt tokens: width groups instead
    assert not verify_batch(ctxs, prefill, prop, ROWS, 63, FeatureNeed.NONE).packed
    meta = Proposal.chain(prop.tokens.to("meta"), None, KS)  # another device: the padded pass
    assert not verify_batch(ctxs, tlens, meta, ROWS, 63, FeatureNeed.NONE).packed
