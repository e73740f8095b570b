"""oneDNN-packed bf16 CPU linears: the same function as the bf16 nn.Linear, row by row, and through the engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from util import PROMPTS, fused_gemm_count

from engine import Engine, SamplingParams
from engine.api.options import KernelOptions, PrecisionConfig, SpeculationConfig
from engine.core.checkpoint import load_model
from engine.core.config import load_config
from engine.core.errors import InvalidConfigError
from engine.core.model import FusedLinear, fuse_projections
from engine.kernels.cpu_linear import (
    OneDNNLinear,
    PackedFused,
    onednn_bf16_available,
    pack_linears,
    packed_bytes,
)
from quant.catalog import lookup_gpu
from quant.plan import make_plan

needs_onednn = pytest.mark.skipif(not onednn_bf16_available(), reason="this CPU/PyTorch has no oneDNN bf16 kernels")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_linear_for_every_row_count_and_rows_are_independent(bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 80, bias=bias).bfloat16()
    packed = OneDNNLinear(lin)
    ref = nn.Linear(96, 80, bias=bias)
    ref.load_state_dict({k: v.float() for k, v in lin.state_dict().items()})
    x = torch.randn(17, 96).bfloat16()
    full = packed(x)
    for rows in (1, 2, 3, 5, 8, 16, 17):
        got = packed(x[:rows])
        # each row is computed on its own: a verify pass of K+1 rows gives the one-row results bit for bit
        assert torch.equal(got, full[:rows])
        # the fp32 result of the same bf16 inputs, up to the bf16 rounding of the output
        torch.testing.assert_close(got.float(), ref(x[:rows].float()), rtol=1e-2, atol=1e-2)
    assert torch.equal(packed(x.view(1, 17, 96)), full.view(1, 17, 80))


@needs_onednn
def test_pack_linears_swaps_bf16_linears_packs_fused_groups_and_keeps_the_checkpoint(ckpt_dir):
    model = load_model(ckpt_dir, torch.bfloat16)
    names = set(model.state_dict())
    want = fused_gemm_count(model)  # q,k,v,gate,up run fused
    assert pack_linears(model) == want
    a = model.layers[0].self_attn
    assert isinstance(a.qkv, PackedFused) and isinstance(a.o_proj, OneDNNLinear)
    assert type(a.q_proj) is nn.Linear  # its GEMM is the fused one: no second packed copy
    assert model.lm_head.weight is model.embed_tokens.weight or not model.config.tie_word_embeddings
    assert set(model.state_dict()) == names  # packed copies are not saved
    assert packed_bytes(model) > 0


@needs_onednn
def test_packed_model_logits_match_the_fp32_model_within_bf16_rounding(ckpt_dir):
    tokens = torch.tensor([[1, 5, 9, 33, 2, 7, 120, 44]])
    ref = load_model(ckpt_dir, torch.float32)(tokens)
    plain = load_model(ckpt_dir, torch.bfloat16)
    fuse_projections(plain)
    unpacked = plain(tokens).float()
    pack_linears(plain)
    packed = plain(tokens).float()
    scale = ref.abs().max()
    assert (packed - unpacked).abs().max() <= 0.02 * scale
    assert (packed - ref).abs().max() <= 0.05 * scale


@needs_onednn
def test_engine_packs_bf16_by_default_and_decodes(ckpt_dir, draft_dir):
    eng = Engine.from_pretrained(
        ckpt_dir, draft_dir, speculation=SpeculationConfig(k=4, k_policy="constant"), dtype="bfloat16"
    )
    assert eng.info["cpu_packed_linears"] > 0 and eng.info["draft_dtype"] == "float32"
    assert eng.stats()["memory"]["cpu_packed_bytes"] > 0
    out = eng.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_new_tokens=24))[0]
    assert len(out.token_ids) == 24 and eng.stats()["drafted"] > 0
    off = Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=False), dtype="bfloat16")
    assert off.info["cpu_packed_linears"] == 0


def test_attention_choice_and_refusals(ckpt_dir):
    from engine.core.errors import EngineError

    assert Engine.from_pretrained(ckpt_dir).info["attention"] == "sdpa_attention"
    assert (
        Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(attention="math")).info["attention"] == "math_attention"
    )
    with pytest.raises(InvalidConfigError, match="attention='bogus' is invalid: allowed sdpa, math"):
        Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(attention="bogus"))
    with pytest.raises(EngineError, match="attention='math' is invalid with a plan"):
        plan = make_plan(lookup_gpu("a100"), load_config(ckpt_dir), None, device="cpu")
        Engine.from_pretrained(ckpt_dir, precision=PrecisionConfig(plan), kernels=KernelOptions(attention="math"))
    with pytest.raises(InvalidConfigError, match="precision.plan=.* is invalid: allowed a PrecisionPlan"):
        PrecisionConfig(object())
    if onednn_bf16_available():  # bf16 with packed GEMMs: math by default, sdpa on request
        assert Engine.from_pretrained(ckpt_dir, dtype="bfloat16").info["attention"] == "math_attention"
        eng = Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(attention="sdpa"), dtype="bfloat16")
        assert eng.info["attention"] == "sdpa_attention"


def test_cpu_pack_refused_without_onednn_bf16(ckpt_dir, monkeypatch):
    import engine.kernels.cpu_linear as cl

    monkeypatch.setattr(cl, "onednn_bf16_available", lambda: False)
    with pytest.raises(InvalidConfigError, match="cpu_pack=True is invalid here: this CPU/PyTorch has no oneDNN bf16"):
        Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=True), dtype="bfloat16")
    assert Engine.from_pretrained(ckpt_dir, dtype="bfloat16").info["cpu_linear_kernel"] is None


def test_fused_linear_is_the_stacked_linears():
    torch.manual_seed(2)
    a, b = nn.Linear(16, 8), nn.Linear(16, 4)
    x = torch.randn(3, 16)
    want = torch.cat([a(x), b(x)], -1)
    fused = FusedLinear(torch.cat([a.weight, b.weight]), torch.cat([a.bias, b.bias]))
    torch.testing.assert_close(fused(x), want)


# ---------------------------------------------------------------- bf16 speculation is exact


@needs_onednn
def test_bf16_verify_block_equals_one_token_steps_bit_for_bit(ckpt_dir):
    from engine.core.attention import math_attention
    from engine.core.model import KVCache

    m = load_model(ckpt_dir, torch.bfloat16)
    fuse_projections(m)
    pack_linears(m)
    m.attn_fn = math_attention
    toks = torch.randint(1, 290, (1, 48), generator=torch.Generator().manual_seed(3))
    for p0, p1 in ((40, 48), (28, 36)):  # the second block crosses a key bucket (32): its rows see more keys
        outs = []
        for block in (True, False):
            cache = KVCache(m.config, 1, 128, torch.bfloat16, "cpu")
            m(toks[:, :p0], torch.arange(p0)[None], cache, p0)
            if block:
                outs.append(m(toks[:, p0:p1], torch.arange(p0, p1)[None], cache, p1)[0])
            else:
                outs.append(
                    torch.cat([m(toks[:, i : i + 1], torch.tensor([[i]]), cache, i + 1)[0] for i in range(p0, p1)])
                )
        assert torch.equal(outs[0], outs[1]), (p0, p1)


@needs_onednn
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_bf16_greedy_speculation_equals_the_bf16_target_alone(ckpt_dir, draft_dir, drafter):
    params = SamplingParams(max_new_tokens=40)
    plain = Engine.from_pretrained(ckpt_dir, dtype="bfloat16")
    assert plain.info["attention"] == "math_attention" and plain.info["cpu_packed_linears"] > 0
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    for k in (1, 2, 4, 8):
        eng = Engine.from_pretrained(
            ckpt_dir,
            draft_dir if drafter == "model" else None,
            speculation=SpeculationConfig(drafter=drafter, k=k, k_policy="constant"),
            dtype="bfloat16",
        )
        for batch in (1, 4):
            got = []
            for i in range(0, len(PROMPTS), batch):
                got += [o.token_ids for o in eng.generate(PROMPTS[i : i + batch], params)]
            assert got == want, (drafter, k, batch)
        assert eng.stats()["drafted"] > 0


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("mistral", {"num_key_value_heads": 1, "sliding_window": 24})])
def test_math_attention_through_the_cache_equals_sdpa(tmp_path, arch, kw):
    """fp32, any CPU: the math backend's cache path (bucketed keys, rows, ragged positions, a window)."""
    from util import make_checkpoint

    from engine.core.attention import math_attention, sdpa_attention
    from engine.core.model import KVCache

    m = load_model(make_checkpoint(tmp_path / arch, arch, **kw), torch.float32)
    g = torch.Generator().manual_seed(4)
    toks = torch.randint(1, 290, (3, 50), generator=g)
    rows = torch.tensor([2, 0, 1])
    outs = {}
    for name, fn in (("sdpa", sdpa_attention), ("math", math_attention)):
        m.attn_fn = fn
        cache = KVCache(m.config, 3, 128, torch.float32, "cpu")
        lens = [40, 29, 33]  # ragged: the block's rows end at different positions, across a 32 bucket
        pos = torch.stack([torch.arange(n - 10, n) for n in lens])
        m(toks[:, :30], torch.arange(30).expand(3, 30), cache, 30, rows)
        outs[name] = m(toks[:, 30:40], pos, cache, max(lens), rows)
    torch.testing.assert_close(outs["math"], outs["sdpa"], rtol=1e-4, atol=1e-4)
