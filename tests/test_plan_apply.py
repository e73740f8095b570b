"""Applying a precision plan to tiny models: module swaps, tied drafts, refusals, the fp16 plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from util import llama_config

from engine.core.config import ModelConfig
from engine.core.errors import InvalidConfigError, KernelUnavailableError
from engine.core.model import StoredLinear, Transformer
from engine.core.stored_linear import StoredEmbedding
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
    # the verifier's fp16 embeddings and LM head: stored in fp16 (not quantized), computed in fp32
    assert type(target.lm_head) is StoredLinear and target.lm_head.weight.dtype == torch.float16
    assert type(target.embed_tokens) is StoredEmbedding and target.embed_tokens.weight.dtype == torch.float16
    assert target.embed_tokens(toks).dtype == torch.float32
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


def test_a_tied_target_keeps_one_fp16_table_that_follows_no_dtype_cast():
    """A CPU plan's verifier: the tied embedding table and LM head become one fp16 parameter (rounded to nearest),
    rows and logits come out in the compute dtype, and ``.to(dtype)`` moves the compute dtype, not the storage."""
    tc, target = tiny(6, tie_word_embeddings=True)
    ref = target.embed_tokens.weight.detach().clone()
    toks = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = target(toks)
    plan = make_plan(lookup_gpu("a100"), tc, None, device="cpu", int8_kernel="w8a16")
    apply_plan(target, plan.target, collect_activation_stats(target, [toks]))
    emb, head = target.embed_tokens, target.lm_head
    assert type(emb) is StoredEmbedding and type(head) is StoredLinear and head.weight is emb.weight
    assert emb.weight.dtype == torch.float16 and torch.equal(emb.weight, ref.half())
    assert model_weight_bytes(target) == weight_bytes(tc, plan.target)  # the table counted once, in fp16
    with torch.no_grad():
        got = target(toks)
        assert got.dtype == torch.float32 and rel_fro(got, want) <= 0.03
        assert torch.equal(emb(toks[0]), ref.half().float()[toks[0]])  # rows widened exactly
        target.to(torch.float64)
        assert emb.weight.dtype == torch.float16 and emb(toks[0]).dtype == torch.float64
        assert head.weight is emb.weight and target(toks).dtype == torch.float64


def test_a_planned_checkpoint_releases_the_files_memory_map(tmp_path):
    """load_model copies the vectors (norms) out of the safetensors map, so once a CPU plan has replaced every
    matrix, no tensor keeps the map (and the unquantized weights' pages) alive."""
    import gc

    from util import make_checkpoint

    from engine.core.checkpoint import load_model

    path = make_checkpoint(tmp_path / "ckpt", "llama", num_hidden_layers=2)
    weights = str(path / "model.safetensors")

    def mapped() -> bool:
        gc.collect()
        return any(line.rstrip().endswith(weights) for line in Path("/proc/self/maps").read_text().splitlines())

    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps")
    model = load_model(path)
    assert mapped()  # the matrices read the map
    norm = model.layers[0].input_layernorm.weight
    assert norm.untyped_storage().nbytes() == norm.numel() * norm.element_size()  # a copy of its own
    plan = make_plan(lookup_gpu("a100"), model.config, None, device="cpu", int8_kernel="w8a16")
    toks = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    apply_plan(model, plan.target, collect_activation_stats(model, [toks]))
    assert not mapped()
