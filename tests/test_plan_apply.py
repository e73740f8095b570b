"""Applying a precision plan to tiny models: module swaps, tied drafts, refusals, the fp16 plan."""

from __future__ import annotations

import json

import pytest
import torch
from util import llama_config

from engine.core.config import ModelConfig
from engine.core.errors import InvalidConfigError, KernelUnavailableError
from engine.core.model import StoredLinear, Transformer
from quant.apply import apply_plan, collect_activation_stats, model_weight_bytes
from quant.catalog import (
    lookup_gpu,
)
from quant.linear import FP8Embedding, FP8Linear, Int8Linear
from quant.memory import weight_bytes
from quant.plan import make_plan
from quant.plan_io import plan_from_dict

cfg = llama_config


LLAMA2_7B = cfg()


def tiny(seed: int, **kw) -> tuple[ModelConfig, Transformer]:
    c = cfg(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **kw,
    )
    torch.manual_seed(seed)
    m = Transformer(c).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    return c, m


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("gpu,int8_kernel", [("h100", "w8a8"), ("a100", "llm-int8")])
def test_apply_plan_to_target_and_tied_draft(gpu, int8_kernel):
    tc, target = tiny(0)
    dc, draft = tiny(1, tie_word_embeddings=True)
    toks = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref_t, ref_d = target(toks), draft(toks)
    plan = make_plan(lookup_gpu(gpu), tc, dc, device="cpu", int8_kernel=int8_kernel)
    calib = collect_activation_stats(
        target, [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))]
    )
    assert sorted(calib) == sorted(
        f"layers.{i}.mlp.{n}" for i in range(2) for n in ("gate_proj", "up_proj", "down_proj")
    )
    apply_plan(target, plan.target, calib)
    apply_plan(draft, plan.draft)
    assert (
        isinstance(target.layers[1].mlp.down_proj, Int8Linear) and target.layers[1].mlp.down_proj.kernel == int8_kernel
    )
    q_proj = target.layers[0].self_attn.q_proj  # the plan's fp16 attention: stored in fp16, computed in fp32
    assert type(q_proj) is StoredLinear and q_proj.weight.dtype == torch.float16 and q_proj.bias is None
    assert type(target.lm_head) is torch.nn.Linear and target.lm_head.weight.dtype == torch.float32
    assert isinstance(draft.embed_tokens, FP8Embedding) and isinstance(draft.lm_head, FP8Linear)
    assert draft.lm_head.weight is draft.embed_tokens.weight  # tied stays tied
    assert draft.layers[0].mlp.up_proj.kernel == plan.draft.families["ffn"].kernel
    # bytes: the config-only estimate equals what the applied model stores
    assert model_weight_bytes(target) == weight_bytes(tc, plan.target)
    assert model_weight_bytes(draft) == weight_bytes(dc, plan.draft)
    with torch.no_grad():
        assert rel_fro(target(toks), ref_t) <= 0.03
        assert rel_fro(draft(toks), ref_d) <= 0.12


def test_apply_refuses_missing_calibration_wrong_model_and_missing_kernels():
    tc, target = tiny(4)
    dc, draft = tiny(5)
    plan = make_plan(lookup_gpu("h100"), tc, dc, device="cpu")
    with pytest.raises(InvalidConfigError, match="calib is missing layers.0.mlp.gate_proj.*SmoothQuant"):
        apply_plan(target, plan.target)
    other = make_plan(lookup_gpu("h100"), LLAMA2_7B, None, device="cpu")
    with pytest.raises(InvalidConfigError, match="hidden_size=4096 but the model has 64"):
        apply_plan(target, other.target)
    te = plan_from_dict(json.loads(plan.to_json()))
    te.draft.families["ffn"].kernel = "te"
    if not __import__("importlib").util.find_spec("transformer_engine"):
        with pytest.raises(KernelUnavailableError, match="'te'"):
            apply_plan(draft, te.draft)
        assert type(draft.layers[0].mlp.up_proj) is torch.nn.Linear  # nothing swapped
    no_sq = make_plan(lookup_gpu("h100"), tc, dc, device="cpu", smoothquant_alpha=None)
    apply_plan(target, no_sq.target)  # no calibration needed without SmoothQuant
    assert target.layers[0].mlp.gate_proj.smooth is None


def test_fp16_plan_on_cpu_casts_the_dense_parts():
    tc, target = tiny(6)
    dc, draft = tiny(7)
    plan = make_plan(lookup_gpu("h100"), tc, dc, smoothquant_alpha=None)  # the GPU plan: fp16 compute
    apply_plan(target, plan.target)
    apply_plan(draft, plan.draft)
    assert target.norm.weight.dtype == torch.float16 and target.layers[0].mlp.up_proj.weight.dtype == torch.int8
    assert draft.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    out = draft(torch.randint(0, 128, (1, 5)))
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert model_weight_bytes(draft) == weight_bytes(dc, plan.draft)


@pytest.mark.gpu
def test_gpu_apply_plan_fp16():
    cc = torch.cuda.get_device_capability()
    gpu = "h200" if cc >= (8, 9) else "a100" if cc >= (8, 0) else "t4"
    tc, target = tiny(8)
    dc, draft = tiny(9, tie_word_embeddings=True)
    target, draft = target.cuda().half(), draft.cuda().half()
    toks = torch.randint(0, 128, (2, 12), device="cuda")
    with torch.no_grad():
        ref_t, ref_d = target(toks).float(), draft(toks).float()
    plan = make_plan(lookup_gpu(gpu), tc, dc)
    apply_plan(target, plan.target, collect_activation_stats(target, [toks]))
    apply_plan(draft, plan.draft)
    assert draft.lm_head.weight is draft.embed_tokens.weight
    with torch.no_grad():
        assert rel_fro(target(toks), ref_t) <= 0.03
        assert rel_fro(draft(toks), ref_d) <= 0.12
    assert model_weight_bytes(draft) == weight_bytes(dc, plan.draft)
