"""GPU catalog, PrecisionPlan rules, memory plan (hand-computed), JSON round trip, apply_plan."""

from __future__ import annotations

import copy
import json

import pytest
from util import llama_config

from engine.core.errors import InvalidConfigError, KernelUnavailableError, ProfileError
from quant.catalog import (
    compute_capability,
    gpu_for_device_name,
    load_catalog,
    lookup_gpu,
)
from quant.memory import PlanDoesNotFitError
from quant.plan import make_plan
from quant.plan_io import load_plan, plan_from_dict, plan_from_json
from quant.plan_schema import DEFAULT_PRECISION, PrecisionPlan

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


cfg = llama_config


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
