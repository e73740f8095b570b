"""The precision plan: *what* each module family of the target and the draft becomes.

``make_plan(gpu, target_cfg, draft_cfg)`` turns a catalog entry, the model configs
and the precision section (docs/design.md, the precision plan) into a ``PrecisionPlan``; the *how*
(kernels) is quant.matmul_kernels, the module swap is quant.apply; the plan's dataclasses and the precision
section's validation are quant.plan_schema. Rules:

- draft "fp8": every Linear, the LM head and the embedding table in e4m3 (per-row
  scales). Kernel ``native`` (torch._scaled_mm) where the GPU has FP8 tensor cores
  (compute capability >= 8.9), ``weight-only`` (FP8 storage, fp16 matmul) below.
- target: attention "fp16" (dense); FFN "int8" with the ``w8a8`` (+ SmoothQuant
  alpha 0.5) or ``llm-int8`` kernel where the GPU has INT8 tensor cores (>= 7.5), or
  ``w8a16`` (INT8 weight-only, per output channel or per ``group_size`` input channels).
- per layer: ``ModelPlan.modules`` maps a module name (``layers.12.mlp.down_proj``) to its
  own FamilyPlan, overriding its family's; each says why (quant.search fills it from the
  calibration text).
  V100 (7.0) has none: the plan keeps the FFN in fp16 and records why, rather than
  refusing (the build still gets the fp16 attention and FP8 draft savings).
- verifier: the target's embeddings, LM head and every norm stay in the compute
  dtype; softmax and acceptance arithmetic in fp32. KV cache fp16.
- attention backend flash-attn-2 where the GPU supports it (>= 8.0), else sdpa.
- compute dtype fp16 on a GPU (bf16 support is recorded, attention stays "fp16");
  ``device="cpu"`` keeps every storage/kernel choice of the GPU but computes in
  fp32 with an fp32 KV cache and sdpa; its memory plan is still the GPU's.
- memory: weights + KV cache (max_batch x max_seq_len) + workspace (quant.memory)
  under 80% of the GPU's memory, lowering max_batch first, then max_seq_len; when
  batch 1 at MIN_SEQ_LEN does not fit, PlanDoesNotFitError with the figures.
"""

from __future__ import annotations

import copy
from typing import Any

from engine.core.config import ModelConfig
from engine.core.errors import InvalidConfigError, KernelUnavailableError

from . import memory as mem
from .catalog import compute_capability, validate_gpu
from .head_plan import head_linears, head_model_plan, head_shape, head_weight_bytes
from .matmul_kernels import FP8_KERNELS, INT8_KERNELS, LLM_INT8_THRESHOLD
from .plan_schema import (
    DEFAULT_PRECISION,
    FAMILIES,
    FamilyPlan,
    MemoryPlan,
    ModelPlan,
    PrecisionPlan,
    validate_precision,
)
from .smooth import DEFAULT_ALPHA

BUDGET_FRACTION = 0.8
MIN_SEQ_LEN = 256
SEQ_STEP = 256


class PlanDoesNotFitError(InvalidConfigError):
    """Even batch 1 at the minimum sequence length exceeds the memory budget."""


def _shape(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def _dense(dt: str, reason: str = "") -> FamilyPlan:
    return FamilyPlan(dt, "dense", {}, reason)


def _fp8_family(kernel: str, what: str) -> FamilyPlan:
    acts = {
        "native": "per-token dynamic e4m3",
        "te": "per-tensor delayed scaling (transformer-engine)",
        "weight-only": "none: weights dequantized to the compute dtype for the matmul",
    }[kernel]
    return FamilyPlan(
        "fp8_e4m3",
        kernel,
        {"weights": "per-output-channel e4m3, fp32 scales", "activations": acts},
        f"draft {what} in FP8",
    )


def w8a16_family(group_size: int | None, reason: str = "main_model.ffn = int8") -> FamilyPlan:
    """INT8 weight-only: activations stay in the compute dtype."""
    w = (
        "per-output-channel symmetric int8, fp32 scales"
        if group_size is None
        else f"symmetric int8 per group of {group_size} input channels, fp32 scales"
    )
    return FamilyPlan(
        "int8", "w8a16", {"weights": w, "activations": "none: the compute dtype", "group_size": group_size}, reason
    )


def _int8_family(kernel: str, alpha: float | None, group_size: int | None = None) -> FamilyPlan:
    if kernel == "w8a16":
        return w8a16_family(group_size)
    s: dict[str, Any] = {
        "weights": "per-output-channel symmetric int8, fp32 scales",
        "activations": "per-token dynamic symmetric int8",
    }
    if kernel == "w8a8":
        s["smoothquant_alpha"] = alpha
    else:
        s["outlier_threshold"] = LLM_INT8_THRESHOLD
        s["activations"] += f"; columns with |x| > {LLM_INT8_THRESHOLD} in fp16"
    return FamilyPlan("int8", kernel, s, "main_model.ffn = int8")


def _fit(
    memory_bytes: int, cfgs: list[ModelConfig], weights: int, max_batch: int, max_seq_len: int, gpu: str
) -> tuple[int, int, list[str]]:
    budget = int(memory_bytes * BUDGET_FRACTION)
    notes: list[str] = []
    if mem.total_bytes(weights, cfgs, max_batch, max_seq_len) <= budget:
        return max_batch, max_seq_len, notes
    for b in range(max_batch - 1, 0, -1):
        if mem.total_bytes(weights, cfgs, b, max_seq_len) <= budget:
            notes.append(f"max_batch lowered {max_batch} -> {b} to fit {BUDGET_FRACTION:.0%} of {gpu} memory")
            return b, max_seq_len, notes
    L = (max_seq_len - 1) // SEQ_STEP * SEQ_STEP
    while L >= MIN_SEQ_LEN:
        if mem.total_bytes(weights, cfgs, 1, L) <= budget:
            notes.append(
                f"max_batch lowered {max_batch} -> 1 and max_seq_len {max_seq_len} -> {L} to fit "
                f"{BUDGET_FRACTION:.0%} of {gpu} memory"
            )
            return 1, L, notes
        L -= SEQ_STEP
    need = mem.total_bytes(weights, cfgs, 1, min(MIN_SEQ_LEN, max_seq_len))
    raise PlanDoesNotFitError(
        f"gpu={gpu}: the plan does not fit: weights {weights} B + KV cache and workspace at batch 1, "
        f"seq_len {min(MIN_SEQ_LEN, max_seq_len)} need {need} B; the budget is {budget} B "
        f"({BUDGET_FRACTION:.0%} of {memory_bytes} B)"
    )


def make_plan(
    gpu: dict[str, Any],
    target_cfg: ModelConfig,
    draft_cfg: ModelConfig | None,
    precision: dict[str, Any] = DEFAULT_PRECISION,
    *,
    max_batch: int = 32,
    max_seq_len: int = 4096,
    int8_kernel: str = "w8a8",
    fp8_kernel: str | None = None,
    smoothquant_alpha: float | None = DEFAULT_ALPHA,
    device: str = "cuda",
    group_size: int | None = None,
    draft_head: dict[str, Any] | None = None,
) -> PrecisionPlan:
    """The plan for ``gpu`` (a catalog entry, see quant.catalog.lookup_gpu) and the two models.

    ``fp8_kernel`` None picks native / weight-only from the GPU; ``smoothquant_alpha``
    None turns SmoothQuant off for w8a8. ``device="cpu"`` is the variant that runs on the CPU.
    ``group_size``: input channels per weight scale of the ``w8a16`` kernel (None: per output channel).
    ``draft_head``: the draft is a trained head (its config as a dict, ``dataclasses.asdict(HeadConfig)``;
    draft_cfg None): the draft part is the head's (quant.head_plan).
    """
    validate_gpu(gpu, "gpu")
    if draft_head is not None and draft_cfg is not None:
        raise InvalidConfigError("draft_head is given with draft_cfg: the draft is a model or a head, not both")
    head = None if draft_head is None else head_shape(draft_head)
    name = str(gpu.get("name", "gpu"))
    precision = validate_precision(precision)
    if device not in ("cuda", "cpu"):
        raise InvalidConfigError(f"device={device!r} is invalid: allowed cuda, cpu")
    if int8_kernel not in INT8_KERNELS:
        raise InvalidConfigError(f"int8_kernel={int8_kernel!r} is invalid: allowed {', '.join(INT8_KERNELS)}")
    if fp8_kernel is not None and fp8_kernel not in FP8_KERNELS:
        raise InvalidConfigError(f"fp8_kernel={fp8_kernel!r} is invalid: allowed {', '.join(FP8_KERNELS)} or None")
    if group_size is not None and (
        int8_kernel != "w8a16" or not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1
    ):
        raise InvalidConfigError(
            f"group_size={group_size!r} is invalid with int8_kernel={int8_kernel!r}: allowed "
            "an int >= 1 with 'w8a16', else None"
        )
    if smoothquant_alpha is not None and not 0.0 <= smoothquant_alpha <= 1.0:
        raise InvalidConfigError(f"smoothquant_alpha={smoothquant_alpha!r} is invalid: allowed 0.0 .. 1.0 or None")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise InvalidConfigError(f"max_batch={max_batch!r} is invalid: allowed an integer >= 1")
    if not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise InvalidConfigError(f"max_seq_len={max_seq_len!r} is invalid: allowed an integer >= 1")
    cc = compute_capability(gpu)
    cc_text = f"{cc[0]}.{cc[1]}"
    tc = gpu["tensor_cores"]
    notes: list[str] = []
    dt = "fp16" if device == "cuda" else "fp32"
    if device == "cpu":
        notes.append(
            f"device=cpu: storage and kernels as planned for {name}, computed in fp32 with an fp32 KV "
            "cache and sdpa attention; the memory plan is the GPU's (fp16)"
        )
    if tc["bf16"]:
        notes.append(f"{name} has bf16 tensor cores; compute stays fp16 as the precision section asks")
    else:
        notes.append(f"{name} (sm_{cc[0]}{cc[1]}) has no bf16 tensor cores: fp16 only")

    # draft
    if fp8_kernel is None:
        fp8_kernel = "native" if tc["fp8"] else "weight-only"
    elif fp8_kernel in ("native", "te") and not tc["fp8"]:
        raise KernelUnavailableError(
            f"fp8 kernel {fp8_kernel!r} needs FP8 tensor cores (compute capability >= 8.9);"
            f" {name} is sm_{cc[0]}{cc[1]} — use 'weight-only'"
        )
    if fp8_kernel == "te" and device == "cpu":
        raise KernelUnavailableError("fp8 kernel 'te' (transformer_engine) runs on CUDA only — use 'native' on the CPU")
    draft = None
    if draft_cfg is not None:
        if precision["draft_model"] == "fp8":
            fams = {
                "attention": _fp8_family(fp8_kernel, "attention"),
                "ffn": _fp8_family(fp8_kernel, "ffn"),
                "embeddings": FamilyPlan(
                    "fp8_e4m3",
                    "weight-only",
                    {"weights": "per-row e4m3, fp32 scales"},
                    "draft embedding table in FP8, dequantized on lookup",
                ),
                "lm_head": _fp8_family(fp8_kernel, "LM head"),
                "norms": _dense(dt),
            }
            if draft_cfg.tie_word_embeddings:
                fams["lm_head"].scaling["tied"] = "shares the FP8 embedding table and its per-row scales"
            why = "FP8 tensor cores" if tc["fp8"] else "no FP8 tensor cores: FP8 storage, fp16 matmul (saves memory)"
            notes.append(f"draft FP8 kernel {fp8_kernel!r} on {name} (sm_{cc[0]}{cc[1]}: {why})")
        else:
            fams = {f: _dense(dt) for f in FAMILIES}
        draft = ModelPlan("draft", dt, fams, _shape(draft_cfg))
    elif head is not None:
        fp8 = _fp8_family(fp8_kernel, "head") if precision["draft_model"] == "fp8" else None
        draft = head_model_plan(*head, fp8, dt)
        names = [n for n, _, _ in head_linears(*head)]
        if draft.families["ffn"].quantized:
            notes.append(
                f"draft {head[0]} head: {', '.join(names)} in FP8 ({fp8_kernel!r}); its LM head and embedding "
                "table are the target's (verifier precision)"
            )
        else:
            notes.append(f"draft {head[0]} head: {draft.families['ffn'].reason}")

    # target
    if precision["main_model"]["ffn"] == "int8" and tc["int8"]:
        ffn = _int8_family(int8_kernel, smoothquant_alpha, group_size)
    elif precision["main_model"]["ffn"] == "int8":
        ffn = _dense(dt, f"{name} (sm_{cc[0]}{cc[1]}) has no INT8 tensor cores: FFN kept in fp16")
        notes.append(ffn.reason)
    else:
        ffn = _dense(dt, "main_model.ffn = fp16")
    target = ModelPlan(
        "target",
        dt,
        {
            "attention": _dense(dt, "main_model.attention = fp16"),
            "ffn": ffn,
            "embeddings": _dense(dt),
            "lm_head": _dense(dt, "verifier: never quantized"),
            "norms": _dense(dt, "verifier: never quantized"),
        },
        _shape(target_cfg),
    )

    # memory, always for the GPU in fp16
    cfgs = [target_cfg] + ([draft_cfg] if draft_cfg is not None else [])
    tw = mem.weight_bytes(target_cfg, target, compute_bytes=2)
    dw = mem.weight_bytes(draft_cfg, draft, compute_bytes=2) if draft is not None and draft_cfg is not None else 0
    if head is not None:  # a head keeps no KV cache; its weights only
        dw = head_weight_bytes(*head, draft, compute_bytes=2)
    b, L, adj = _fit(gpu["memory_bytes"], cfgs, tw + dw, max_batch, max_seq_len, name)
    kv_tok = sum(mem.kv_bytes_per_token(c) for c in cfgs)
    memory = MemoryPlan(
        memory_bytes=gpu["memory_bytes"],
        budget_fraction=BUDGET_FRACTION,
        budget_bytes=int(gpu["memory_bytes"] * BUDGET_FRACTION),
        target_weight_bytes=tw,
        target_fp16_bytes=mem.fp16_weight_bytes(target_cfg),
        draft_weight_bytes=dw,
        draft_fp16_bytes=mem.fp16_weight_bytes(draft_cfg)
        if draft_cfg is not None
        else (head_weight_bytes(*head, None, compute_bytes=2) if head is not None else 0),
        kv_bytes_per_token=kv_tok,
        kv_cache_bytes=b * L * kv_tok,
        workspace_bytes=mem.workspace_bytes(cfgs, b, L),
        workspace_formula=mem.WORKSPACE_FORMULA,
        total_bytes=mem.total_bytes(tw + dw, cfgs, b, L),
        max_batch=b,
        max_seq_len=L,
        requested_max_batch=max_batch,
        requested_max_seq_len=max_seq_len,
        adjustments=adj,
    )
    backend = "flash-attn-2" if gpu["flash_attn_2"] and device == "cuda" else "sdpa"
    hardware = {
        "tensor_cores": dict(tc),
        "flash_attn_2": gpu["flash_attn_2"],
        "memory_bandwidth_gbps": gpu.get("memory_bandwidth_gbps"),
    }
    return PrecisionPlan(
        gpu=name,
        device=device,
        compute_capability=cc_text,
        hardware=hardware,
        precision=precision,
        compute_dtype=dt,
        attention_backend=backend,
        kv_cache_dtype="fp16" if device == "cuda" else "fp32",
        verifier={"final_norm": dt, "lm_head": dt, "softmax": "fp32", "acceptance": "fp32"},
        target=target,
        draft=draft,
        memory=memory,
        notes=notes + adj,
    )


def with_target_choices(
    plan: PrecisionPlan,
    ffn: FamilyPlan,
    modules: dict[str, FamilyPlan],
    target_cfg: ModelConfig,
    draft_cfg: ModelConfig | None,
    note: str,
) -> PrecisionPlan:
    """A copy of ``plan`` whose target FFN is ``ffn`` with per-layer ``modules``; the memory plan redone."""
    new = copy.deepcopy(plan)
    new.target.families["ffn"] = copy.deepcopy(ffn)
    new.target.modules = copy.deepcopy(modules)
    m = new.memory
    cfgs = [target_cfg] + ([draft_cfg] if draft_cfg is not None else [])
    tw = mem.weight_bytes(target_cfg, new.target, compute_bytes=2)
    b, L, adj = _fit(
        m.memory_bytes, cfgs, tw + m.draft_weight_bytes, m.requested_max_batch, m.requested_max_seq_len, new.gpu
    )
    kv_tok = sum(mem.kv_bytes_per_token(c) for c in cfgs)
    new.memory = MemoryPlan(
        memory_bytes=m.memory_bytes,
        budget_fraction=m.budget_fraction,
        budget_bytes=m.budget_bytes,
        target_weight_bytes=tw,
        target_fp16_bytes=m.target_fp16_bytes,
        draft_weight_bytes=m.draft_weight_bytes,
        draft_fp16_bytes=m.draft_fp16_bytes,
        kv_bytes_per_token=kv_tok,
        kv_cache_bytes=b * L * kv_tok,
        workspace_bytes=mem.workspace_bytes(cfgs, b, L),
        workspace_formula=m.workspace_formula,
        total_bytes=mem.total_bytes(tw + m.draft_weight_bytes, cfgs, b, L),
        max_batch=b,
        max_seq_len=L,
        requested_max_batch=m.requested_max_batch,
        requested_max_seq_len=m.requested_max_seq_len,
        adjustments=adj,
    )
    new.notes = [n for n in new.notes if n not in m.adjustments] + [note] + adj
    return new
