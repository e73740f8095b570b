"""Memory arithmetic of a plan, from model configs only (no tensors are loaded).

Weights, per Linear [out N, in K] (b = bytes of the compute dtype, 2 on a GPU):
    dense        N*K*b  (dense storage is the compute dtype)                          (+ N*b bias)
    fp8_e4m3     N*K + 4*N                (e4m3 data, fp32 scale per output channel; + N*b bias)
    int8         N*K + 4*N (+ 4*K SmoothQuant factors)                           (+ N*b bias)
                 per group of g input channels (w8a16): N*K + 4*N*ceil(K/g)
A per-layer override (ModelPlan.modules) counts for its own module.
Embedding [V, H]: dense V*H*b; fp8_e4m3 V*H + 4*V. A tied LM head is the embedding's
table and counts once. Norms: (2 * layers + 1) * H * b.

KV cache, per token per model: 2 (k and v) * layers * kv_heads * head_dim * 2 bytes (fp16).

Workspace (stated formula, not measured):
    WORKSPACE_FIXED_BYTES (CUDA context, cuBLAS workspace, allocator slack)
    + batch * min(seq_len, PREFILL_CHUNK) * max over models of
      (2 * (4 * hidden + 3 * intermediate)   fp16 activations of one block
       + 6 * vocab)                          fp16 logits + their fp32 copy for sampling
i.e. one forward of PREFILL_CHUNK tokens per sequence in flight at a time.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine.core.config import ModelConfig
from engine.core.errors import InvalidConfigError

from .plan_schema import MemoryPlan

BUDGET_FRACTION = 0.8  # of the GPU's memory for weights, KV cache and workspace
MIN_SEQ_LEN = 256
SEQ_STEP = 256


class PlanDoesNotFitError(InvalidConfigError):
    """Even batch 1 at the minimum sequence length exceeds the memory budget."""


class FamilyPlan(Protocol):
    """What this module reads of ``quant.plan.FamilyPlan``."""

    storage: str
    scaling: dict[str, Any]


class ModelPlan(Protocol):
    """What this module reads of ``quant.plan.ModelPlan``."""

    compute_dtype: str
    families: dict[str, Any]

    def module_plan(self, name: str, family: str) -> Any: ...


FAMILY_LEAVES = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "ffn": ("gate_proj", "up_proj", "down_proj")}
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8_e4m3": 1, "int8": 1}
KV_DTYPE_BYTES = 2
WORKSPACE_FIXED_BYTES = 512 * 2**20
PREFILL_CHUNK = 512
WORKSPACE_FORMULA = (
    f"{WORKSPACE_FIXED_BYTES} + batch * min(seq_len, {PREFILL_CHUNK}) * "
    "max_over_models(2 * (4 * hidden + 3 * intermediate) + 6 * vocab)"
)


def linear_bytes(n_out: int, n_in: int, bias: bool, fam: FamilyPlan, b: int) -> int:
    """Stored bytes of one Linear planned as ``fam`` with compute dtype of ``b`` bytes."""
    bias_bytes = n_out * b if bias else 0
    if fam.storage in ("fp8_e4m3", "int8"):
        smooth = 4 * n_in if fam.scaling.get("smoothquant_alpha") is not None else 0
        g = fam.scaling.get("group_size")
        scales = 4 * n_out * (1 if g is None else -(-n_in // int(g)))
        return n_out * n_in + scales + smooth + bias_bytes
    return n_out * n_in * min(DTYPE_BYTES[fam.storage], b) + bias_bytes  # dense: its storage (at most the compute's)


def embedding_bytes(vocab: int, hidden: int, fam: FamilyPlan, b: int) -> int:
    """Stored bytes of an embedding table planned as ``fam`` with compute dtype of ``b`` bytes."""
    if fam.storage == "fp8_e4m3":
        return vocab * hidden + 4 * vocab
    return vocab * hidden * min(DTYPE_BYTES[fam.storage], b)  # dense: its storage (at most the compute's)


def weight_bytes(cfg: ModelConfig, plan: ModelPlan, compute_bytes: int | None = None) -> int:
    """Bytes the planned model stores (what ``quant.apply.model_weight_bytes`` measures after apply_plan)."""
    b = DTYPE_BYTES[plan.compute_dtype] if compute_bytes is None else compute_bytes
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {
        "q_proj": (q, h, cfg.attention_bias),
        "k_proj": (kv, h, cfg.attention_bias),
        "v_proj": (kv, h, cfg.attention_bias),
        "o_proj": (h, q, cfg.o_bias),
        "gate_proj": (i, h, cfg.mlp_bias),
        "up_proj": (i, h, cfg.mlp_bias),
        "down_proj": (h, i, cfg.mlp_bias),
    }
    linears = 0
    for layer in range(L):
        for fam, part in (("attention", "self_attn"), ("ffn", "mlp")):
            for leaf in FAMILY_LEAVES[fam]:
                n_out, n_in, bias = shapes[leaf]
                linears += linear_bytes(n_out, n_in, bias, plan.module_plan(f"layers.{layer}.{part}.{leaf}", fam), b)
    norms = (2 * L + 1) * h * b
    emb = embedding_bytes(cfg.vocab_size, h, plan.families["embeddings"], b)
    head = 0 if cfg.tie_word_embeddings else linear_bytes(cfg.vocab_size, h, False, plan.families["lm_head"], b)
    return linears + norms + emb + head


def fp16_weight_bytes(cfg: ModelConfig) -> int:
    """The same model unquantized in fp16 (2 bytes per parameter; a tied table counts once)."""
    return 2 * cfg.num_parameters()


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * KV_DTYPE_BYTES


def workspace_bytes_per_token(cfgs: list[ModelConfig]) -> int:
    return max(2 * (4 * c.hidden_size + 3 * c.intermediate_size) + 6 * c.vocab_size for c in cfgs)


def workspace_bytes(cfgs: list[ModelConfig], batch: int, seq_len: int) -> int:
    return WORKSPACE_FIXED_BYTES + batch * min(seq_len, PREFILL_CHUNK) * workspace_bytes_per_token(cfgs)


def total_bytes(weights: int, cfgs: list[ModelConfig], batch: int, seq_len: int) -> int:
    kv = batch * seq_len * sum(kv_bytes_per_token(c) for c in cfgs)
    return weights + kv + workspace_bytes(cfgs, batch, seq_len)


def fit(
    memory_bytes: int, cfgs: list[ModelConfig], weights: int, max_batch: int, max_seq_len: int, gpu: str
) -> tuple[int, int, list[str]]:
    """(max_batch, max_seq_len, notes) within the budget: batch lowered first, then the length."""
    budget = int(memory_bytes * BUDGET_FRACTION)
    notes: list[str] = []
    if total_bytes(weights, cfgs, max_batch, max_seq_len) <= budget:
        return max_batch, max_seq_len, notes
    for b in range(max_batch - 1, 0, -1):
        if total_bytes(weights, cfgs, b, max_seq_len) <= budget:
            notes.append(f"max_batch lowered {max_batch} -> {b} to fit {BUDGET_FRACTION:.0%} of {gpu} memory")
            return b, max_seq_len, notes
    L = (max_seq_len - 1) // SEQ_STEP * SEQ_STEP
    while L >= MIN_SEQ_LEN:
        if total_bytes(weights, cfgs, 1, L) <= budget:
            notes.append(
                f"max_batch lowered {max_batch} -> 1 and max_seq_len {max_seq_len} -> {L} to fit "
                f"{BUDGET_FRACTION:.0%} of {gpu} memory"
            )
            return 1, L, notes
        L -= SEQ_STEP
    need = total_bytes(weights, cfgs, 1, min(MIN_SEQ_LEN, max_seq_len))
    raise PlanDoesNotFitError(
        f"gpu={gpu}: the plan does not fit: weights {weights} B + KV cache and workspace at batch 1, "
        f"seq_len {min(MIN_SEQ_LEN, max_seq_len)} need {need} B; the budget is {budget} B "
        f"({BUDGET_FRACTION:.0%} of {memory_bytes} B)"
    )


def memory_plan(
    gpu: str,
    memory_bytes: int,
    cfgs: list[ModelConfig],
    target: tuple[int, int],
    draft: tuple[int, int],
    requested: tuple[int, int],
) -> MemoryPlan:
    """The memory plan, for the GPU in fp16, with batch and length lowered (``fit``) to the budget.
    ``target``, ``draft``: (planned weight bytes, fp16 weight bytes); ``requested``: (max_batch, max_seq_len)."""
    weights = target[0] + draft[0]
    b, L, adj = fit(memory_bytes, cfgs, weights, requested[0], requested[1], gpu)
    kv_tok = sum(kv_bytes_per_token(c) for c in cfgs)
    return MemoryPlan(
        memory_bytes=memory_bytes,
        budget_fraction=BUDGET_FRACTION,
        budget_bytes=int(memory_bytes * BUDGET_FRACTION),
        target_weight_bytes=target[0],
        target_fp16_bytes=target[1],
        draft_weight_bytes=draft[0],
        draft_fp16_bytes=draft[1],
        kv_bytes_per_token=kv_tok,
        kv_cache_bytes=b * L * kv_tok,
        workspace_bytes=workspace_bytes(cfgs, b, L),
        workspace_formula=WORKSPACE_FORMULA,
        total_bytes=total_bytes(weights, cfgs, b, L),
        max_batch=b,
        max_seq_len=L,
        requested_max_batch=requested[0],
        requested_max_seq_len=requested[1],
        adjustments=adj,
    )
