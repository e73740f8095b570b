"""MKL-packed CPU linears: the same function as nn.Linear, on every row count and through the engine."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import Engine, SamplingParams
from engine.cpu_linear import PackedLinear, pack_linears, packed_bytes, packing_available
from engine.errors import InvalidConfigError

pytestmark = pytest.mark.skipif(not packing_available(), reason="this PyTorch build has no MKL packed linear")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_linear_for_every_row_count(bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 80, bias=bias)
    packed = PackedLinear(lin, buckets=(8, 16))
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 40):
        x = torch.randn(2, rows, 96) if rows % 2 == 0 else torch.randn(rows, 96)
        want = lin(x.double().float())
        got = packed(x)
        assert got.shape == want.shape
        # fp32 GEMM kernels differ only in summation order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padding_rows_do_not_change_real_rows():
    torch.manual_seed(1)
    packed = PackedLinear(nn.Linear(64, 32), buckets=(8,))
    x = torch.randn(5, 64)
    alone = packed(x)
    padded = packed(torch.cat([x, torch.randn(3, 64)]))[:5]
    assert torch.equal(alone, padded)


def test_pack_linears_swaps_fp32_linears_only_and_keeps_ties():
    emb = nn.Embedding(50, 32)
    model = nn.ModuleDict({"a": nn.Linear(32, 32), "head": nn.Linear(32, 50, bias=False),
                           "fp16": nn.Linear(32, 32).half()})
    model["head"].weight = emb.weight
    assert pack_linears(model, buckets=(8,)) == 2
    assert isinstance(model["a"], PackedLinear) and type(model["fp16"]) is nn.Linear
    assert model["head"].weight is emb.weight  # a tied head stays tied
    assert packed_bytes(model) > 0
    assert "packed_8" not in str(list(model.state_dict()))  # checkpoints are unchanged


def test_engine_output_is_identical_with_and_without_packing(ckpt_dir, draft_dir):
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], list(range(20, 45))]
    p = SamplingParams(max_new_tokens=24, temperature=0.0)
    outs = []
    for pack in (False, True):
        eng = Engine.from_pretrained(ckpt_dir, draft_dir, k=4, adaptive_k=False, cpu_pack=pack)
        assert (eng.info["cpu_packed_linears"] > 0) == pack
        outs.append([c.token_ids for c in eng.generate(prompts, p)])
    assert outs[0] == outs[1]


def test_cpu_pack_refused_off_the_cpu_or_in_half_precision(ckpt_dir):
    with pytest.raises(InvalidConfigError, match="cpu_pack"):
        Engine.from_pretrained(ckpt_dir, drafter=None, dtype="float16", cpu_pack=True)
