"""GPU catalog, PrecisionPlan rules, memory plan (hand-computed), JSON round trip, apply_plan."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from engine.core.config import ModelConfig
from engine.core.errors import InvalidConfigError, KernelUnavailableError, ProfileError
from engine.core.model import Transformer
from quant.apply import apply_plan, collect_activation_stats, model_weight_bytes
from quant.catalog import (
    compute_capability,
    gpu_for_device_name,
    load_catalog,
    lookup_gpu,
)
from quant.linear import FP8Embedding, FP8Linear, Int8Linear
from quant.memory import weight_bytes
from quant.plan import DEFAULT_PRECISION, PlanDoesNotFitError, PrecisionPlan, make_plan
from quant.plan_io import load_plan, plan_from_dict, plan_from_json

ALL_GPUS = [
    "a100-40gb",
    "a100-80gb",
    "a10g",
    "l4",
    "l40s",
    "rtx3090",
    "rtx4090",
    "t4",
    "v100",
    "h100-pcie",
    "h100-sxm",
    "h200",
]


def cfg(**kw) -> ModelConfig:
    d = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    }
    d.update(kw)
    return ModelConfig.from_hf_dict(d)


LLAMA2_7B = cfg()
LLAMA_68M = cfg(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=2,
    num_attention_heads=12,
    num_key_value_heads=12,
    tie_word_embeddings=False,
)


# ------------------------------------------------------------------ catalog


def test_catalog_has_every_gpu_with_sourced_facts():
    cat = load_catalog()
    assert sorted(cat["gpus"]) == sorted(ALL_GPUS)
    assert cat["schema_version"] == 1 and cat["aliases"]["a100"] == "a100-80gb"
    for name in ALL_GPUS:
        g = lookup_gpu(name)
        cc = compute_capability(g)
        tc = g["tensor_cores"]
        # DESIGN.md section 4's facts, checked against the data
        assert tc["fp8"] == (cc >= (8, 9)), name
        assert tc["int8"] == (cc >= (7, 5)), name
        assert tc["bf16"] == (cc >= (8, 0)), name
        assert g["flash_attn_2"] == (cc >= (8, 0)), name
        assert g["memory_bytes"] == g["memory_gib"] * 2**30 and g["memory_bandwidth_gbps"] > 0
        assert len(g["source"]) > 20


def test_lookup_is_case_insensitive_with_aliases():
    assert lookup_gpu("A100")["name"] == "a100-80gb"
    assert lookup_gpu(" H100 ")["name"] == "h100-sxm"
    assert lookup_gpu("T4")["compute_capability"] == "7.5"
    assert gpu_for_device_name("NVIDIA H200")["name"] == "h200"


def test_unknown_gpu_lists_the_known_names():
    with pytest.raises(InvalidConfigError) as e:
        lookup_gpu("b200")
    msg = str(e.value)
    assert "b200" in msg and all(n in msg for n in ALL_GPUS) and "a100 -> a100-80gb" in msg


def test_broken_catalog_names_the_field(tmp_path):
    cat = load_catalog()
    del cat["gpus"]["t4"]["flash_attn_2"]
    p = tmp_path / "gpus.json"
    p.write_text(json.dumps(cat))
    with pytest.raises(ProfileError, match="t4.flash_attn_2 is missing"):
        load_catalog(p)


# ------------------------------------------------------------------ plan rules


def plan_for(gpu: str, **kw) -> PrecisionPlan:
    return make_plan(lookup_gpu(gpu), LLAMA2_7B, LLAMA_68M, **kw)


DRAFT_LINEARS = ("attention", "ffn", "lm_head")


def test_a100_draft_is_fp8_weight_only():
    for gpu in ("a100", "a100-40gb", "a10g", "rtx3090", "t4"):
        p = plan_for(gpu)
        for f in DRAFT_LINEARS:
            assert (p.draft.families[f].storage, p.draft.families[f].kernel) == ("fp8_e4m3", "weight-only"), gpu
        assert p.draft.families["embeddings"].storage == "fp8_e4m3"


@pytest.mark.parametrize("gpu", ["h100", "h200", "l4", "rtx4090", "l40s", "h100-pcie"])
def test_fp8_gpus_get_native_fp8_draft(gpu):
    p = plan_for(gpu)
    for f in DRAFT_LINEARS:
        assert (p.draft.families[f].storage, p.draft.families[f].kernel) == ("fp8_e4m3", "native")
    assert p.attention_backend == "flash-attn-2"


def test_t4_is_sdpa_without_bf16():
    p = plan_for("t4")
    assert p.attention_backend == "sdpa" and p.compute_dtype == "fp16"
    assert p.hardware["tensor_cores"]["bf16"] is False
    assert p.target.families["ffn"].storage == "int8"  # Turing has INT8 tensor cores
    assert any("no bf16" in n for n in p.notes)


def test_v100_keeps_the_ffn_in_fp16_and_says_why():
    p = plan_for("v100")
    ffn = p.target.families["ffn"]
    assert (ffn.storage, ffn.kernel) == ("fp16", "dense") and "INT8 tensor cores" in ffn.reason
    assert p.attention_backend == "sdpa"
    assert p.draft.families["ffn"].kernel == "weight-only"


@pytest.mark.parametrize("gpu", ALL_GPUS)
def test_every_plan_leaves_the_verifier_unquantized(gpu):
    for device in ("cuda", "cpu"):
        p = plan_for(gpu, device=device)
        for f in ("lm_head", "norms", "embeddings", "attention"):
            assert not p.target.families[f].quantized, (gpu, f)
        assert p.draft.families["norms"].storage == p.compute_dtype
        assert p.verifier["acceptance"] == "fp32" and p.verifier["lm_head"] == p.compute_dtype
        assert p.kv_cache_dtype == ("fp16" if device == "cuda" else "fp32")
        assert p.precision == DEFAULT_PRECISION


def test_target_ffn_is_int8_with_the_chosen_kernel():
    w = plan_for("a100").target.families["ffn"]
    assert (w.storage, w.kernel, w.scaling["smoothquant_alpha"]) == ("int8", "w8a8", 0.5)
    ll = plan_for("a100", int8_kernel="llm-int8").target.families["ffn"]
    assert (ll.kernel, ll.scaling["outlier_threshold"]) == ("llm-int8", 6.0)


def test_cpu_variant_keeps_the_gpu_choices_in_fp32():
    gpu, cpu = plan_for("h100"), plan_for("h100", device="cpu")
    assert cpu.device == "cpu" and cpu.compute_dtype == "fp32" and cpu.attention_backend == "sdpa"
    assert cpu.draft.families["ffn"].kernel == gpu.draft.families["ffn"].kernel == "native"
    assert plan_for("a100", device="cpu").draft.families["ffn"].kernel == "weight-only"
    assert cpu.memory == gpu.memory  # the memory plan is the GPU's
    assert any("device=cpu" in n for n in cpu.notes)


def test_bad_plan_arguments_name_the_field():
    g = lookup_gpu("h100")
    with pytest.raises(InvalidConfigError, match="int8_kernel='int4'.*w8a8, llm-int8"):
        make_plan(g, LLAMA2_7B, LLAMA_68M, int8_kernel="int4")
    with pytest.raises(InvalidConfigError, match="precision.main_model.ffn='int4'"):
        make_plan(g, LLAMA2_7B, LLAMA_68M, {**DEFAULT_PRECISION, "main_model": {"attention": "fp16", "ffn": "int4"}})
    with pytest.raises(InvalidConfigError, match="max_batch=0"):
        make_plan(g, LLAMA2_7B, LLAMA_68M, max_batch=0)
    with pytest.raises(KernelUnavailableError, match="'native'.*8.9.*a100-80gb"):
        make_plan(lookup_gpu("a100"), LLAMA2_7B, LLAMA_68M, fp8_kernel="native")
    bad = copy.deepcopy(g)
    del bad["tensor_cores"]
    with pytest.raises(ProfileError, match="gpu.tensor_cores is missing"):
        make_plan(bad, LLAMA2_7B, LLAMA_68M)


# ------------------------------------------------------------------ memory, by hand

# Llama-2-7B target, fp16 compute (2 bytes); FFN int8 w8a8 + SmoothQuant:
ATTN_7B = 4 * 4096 * 4096 * 2  # q, k, v, o in fp16
FFN_7B = (
    2 * (11008 * 4096 + 4 * 11008 + 4 * 4096)  # gate, up: int8 + fp32 scale/out + fp32 smooth/in
    + (4096 * 11008 + 4 * 4096 + 4 * 11008)
)  # down
TARGET_7B = 32 * (ATTN_7B + FFN_7B) + (2 * 32 + 1) * 4096 * 2 + 2 * 32000 * 4096 * 2  # + norms + embed + lm_head
# Llama-68M draft, all FP8 (1 byte + fp32 scale per output row), untied, fp16 norms:
ATTN_68M = 4 * (768 * 768 + 4 * 768)
FFN_68M = 2 * (3072 * 768 + 4 * 3072) + (768 * 3072 + 4 * 768)
DRAFT_68M = 2 * (ATTN_68M + FFN_68M) + (2 * 2 + 1) * 768 * 2 + 2 * (32000 * 768 + 4 * 32000)
KV_PER_TOKEN = 2 * 32 * 32 * 128 * 2 + 2 * 2 * 12 * 64 * 2  # k and v, layers, kv heads, head_dim, fp16
WS_PER_TOKEN = 2 * (4 * 4096 + 3 * 11008) + 6 * 32000  # the target's (larger) activations + logits
FIXED = TARGET_7B + DRAFT_68M + 512 * 2**20  # weights + fixed workspace


def per_sequence(seq_len: int) -> int:
    return seq_len * KV_PER_TOKEN + min(seq_len, 512) * WS_PER_TOKEN


def test_hand_figures():
    assert TARGET_7B == 9_154_109_440 and DRAFT_68M == 68_369_920
    assert KV_PER_TOKEN == 530_432 and WS_PER_TOKEN == 290_816
    assert per_sequence(4096) == 2_321_547_264


@pytest.mark.parametrize("gpu,gib,batch", [("a100-40gb", 40, 10), ("t4", 16, 1)])
def test_memory_plan_equals_hand_computation(gpu, gib, batch):
    budget = int(gib * 2**30 * 0.8)
    # largest batch at max_seq_len 4096 under the budget: floor((budget - fixed) / per_sequence)
    assert (budget - FIXED) // per_sequence(4096) == batch
    p = plan_for(gpu)
    m = p.memory
    assert m.budget_bytes == budget
    assert m.target_weight_bytes == TARGET_7B and m.draft_weight_bytes == DRAFT_68M
    assert m.target_fp16_bytes == 2 * LLAMA2_7B.num_parameters() == 13_476_831_232
    assert (m.max_batch, m.max_seq_len) == (batch, 4096)
    assert m.kv_cache_bytes == batch * 4096 * KV_PER_TOKEN
    assert m.total_bytes == FIXED + batch * per_sequence(4096) <= budget
    assert FIXED + (batch + 1) * per_sequence(4096) > budget
    assert m.adjustments and f"32 -> {batch}" in m.adjustments[0]


def test_weight_ratios_meet_the_goals():
    m = plan_for("a100-40gb").memory
    ideal = 2 * (LLAMA2_7B.num_parameters() - 3 * 4096 * 11008 * 32) + 3 * 4096 * 11008 * 32
    assert abs(m.target_weight_bytes / ideal - 1) <= 0.02
    assert round(m.target_weight_bytes / m.target_fp16_bytes, 2) == 0.68
    assert m.draft_weight_bytes / m.draft_fp16_bytes <= 0.55


def test_memory_lowers_seq_len_then_refuses():
    small = lookup_gpu("t4")
    small["memory_bytes"] = 13 * 2**30  # budget 10.4 GiB: batch 1 at 4096 does not fit
    m = make_plan(small, LLAMA2_7B, LLAMA_68M).memory
    budget = int(13 * 2**30 * 0.8)
    L = max(n for n in range(256, 4096, 256) if FIXED + per_sequence(n) <= budget)
    assert (m.max_batch, m.max_seq_len) == (1, L) and 256 <= L < 4096
    small["memory_bytes"] = 11 * 2**30
    with pytest.raises(PlanDoesNotFitError) as e:
        make_plan(small, LLAMA2_7B, LLAMA_68M)
    assert str(int(11 * 2**30 * 0.8)) in str(e.value) and str(FIXED - 512 * 2**20) in str(e.value)


# ------------------------------------------------------------------ JSON


def test_plan_json_round_trip(tmp_path):
    for gpu in ("a100", "t4", "v100", "h200"):
        p = plan_for(gpu)
        q = plan_from_json(p.to_json())
        assert q == p and q.to_json() == p.to_json()
    path = tmp_path / "plan.json"
    p.save(path)
    assert load_plan(path) == p
    assert [f.name for f in tmp_path.iterdir()] == ["plan.json"]  # no temp file left behind


def test_plan_json_refuses_bad_fields():
    d = json.loads(plan_for("h100").to_json())
    cases = [
        (("schema_version",), 99, "plan.schema_version=99 is not supported"),
        (("target", "families", "lm_head", "storage"), "fp8_e4m3", "plan.target.families.lm_head.storage"),
        (("target", "families", "ffn", "kernel"), "cutlass", "plan.target.families.ffn.kernel='cutlass'"),
        (("draft", "families", "norms", "storage"), "int8", "plan.draft.families.norms.storage"),
        (("attention_backend",), "xformers", "plan.attention_backend='xformers'"),
        (("memory", "max_batch"), "many", "plan.memory.max_batch"),
    ]
    for path, value, msg in cases:
        bad = copy.deepcopy(d)
        node = bad
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        with pytest.raises(ProfileError, match=msg.replace("(", r"\(").replace(".", r"\.")):
            plan_from_dict(bad)
    bad = copy.deepcopy(d)
    del bad["target"]["families"]["norms"]
    with pytest.raises(ProfileError, match="plan.target.families.norms is missing"):
        plan_from_dict(bad)
    with pytest.raises(ProfileError, match="invalid JSON"):
        plan_from_json("{not json")


# ------------------------------------------------------------------ apply on tiny models


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
    assert type(target.layers[0].self_attn.q_proj) is torch.nn.Linear and type(target.lm_head) is torch.nn.Linear
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
