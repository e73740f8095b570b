"""The precision plan: *what* each module family of the target and the draft becomes.

``make_plan(gpu, target_cfg, draft_cfg)`` turns a catalog entry, the model configs
and the precision section (docs/design.md, the precision plan) into a ``PrecisionPlan``; the *how*
(kernels) is quant.matmul_kernels, the module swap is quant.apply; the plan's dataclasses and the precision
section's validation are quant.plan_schema. Rules:

- draft "fp8": every Linear, the LM head and the embedding table in e4m3 (per-row
  scales). Kernel ``native`` (torch._scaled_mm) where the GPU has FP8 tensor cores
  (compute capability >= 8.9), ``weight-only`` (FP8 storage, fp16 matmul) below.
- target: attention "fp16" (dense; on the CPU stored in fp16, computed in fp32); FFN "int8" with the
  ``w8a8`` (+ SmoothQuant alpha 0.5) or ``llm-int8`` kernel where the GPU has INT8 tensor cores (>= 7.5), or
  ``w8a16`` (INT8 weight-only, per output channel or per ``group_size`` input channels).
- per layer: ``ModelPlan.modules`` maps a module name (``layers.12.mlp.down_proj``) to its
  own FamilyPlan, overriding its family's; each says why (quant.search fills it from the
  calibration text).
  V100 (7.0) has none: the plan keeps the FFN in fp16 and records why, rather than
  refusing (the build still gets the fp16 attention and FP8 draft savings).
- verifier: the target's embeddings and LM head in fp16 (the precision section's
  ``verifier``), never quantized; every norm in the compute dtype; softmax and
  acceptance arithmetic in fp32. KV cache fp16.
- attention backend flash-attn-2 where the GPU supports it (>= 8.0), else sdpa.
- compute dtype fp16 on a GPU (bf16 support is recorded, attention stays "fp16");
  ``device="cpu"`` keeps every storage/kernel choice of the GPU (fp16 attention,
  embeddings and LM head stored in fp16) but computes in fp32 with an fp32 KV cache
  and sdpa; its memory plan is still the GPU's.
- memory: weights + KV cache (max_batch x max_seq_len) + workspace (quant.memory)
  under 80% of the GPU's memory, lowering max_batch first, then max_seq_len; when
  batch 1 at MIN_SEQ_LEN does not fit, PlanDoesNotFitError with the figures.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
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
    ModelPlan,
    PrecisionPlan,
    validate_precision,
)
from .smooth import DEFAULT_ALPHA


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


@dataclass(frozen=True)
class _Gpu:
    """The planned GPU: its catalog entry and the facts the rules read from it."""

    entry: dict[str, Any]
    """The catalog entry (quant.catalog.lookup_gpu), validated."""
    name: str
    """Its catalog name (``a100-80gb``), as the notes and errors give it."""
    cc: tuple[int, int]
    """Its compute capability, (major, minor)."""

    @property
    def tc(self) -> dict[str, bool]:
        """Its tensor cores per format (fp16, bf16, int8, fp8)."""
        return self.entry["tensor_cores"]

    @property
    def sm(self) -> str:
        """``sm_89`` for compute capability 8.9."""
        return f"sm_{self.cc[0]}{self.cc[1]}"


def _check_options(
    device: str,
    int8_kernel: str,
    fp8_kernel: str | None,
    group_size: int | None,
    smoothquant_alpha: float | None,
    max_batch: int,
    max_seq_len: int,
) -> None:
    """make_plan's options, each refused with an InvalidConfigError naming it and the allowed values."""
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


def _device_notes(gpu: _Gpu, device: str) -> list[str]:
    """The plan's first notes: the CPU variant, and the GPU's bf16 support."""
    notes: list[str] = []
    if device == "cpu":
        notes.append(
            f"device=cpu: storage and kernels as planned for {gpu.name}, computed in fp32 with an fp32 KV "
            "cache and sdpa attention; the memory plan is the GPU's (fp16)"
        )
    if gpu.tc["bf16"]:
        notes.append(f"{gpu.name} has bf16 tensor cores; compute stays fp16 as the precision section asks")
    else:
        notes.append(f"{gpu.name} ({gpu.sm}) has no bf16 tensor cores: fp16 only")
    return notes


def _pick_fp8_kernel(fp8_kernel: str | None, gpu: _Gpu, device: str) -> str:
    """The draft's FP8 kernel: ``fp8_kernel``, or native / weight-only from the GPU when None."""
    if fp8_kernel is None:
        fp8_kernel = "native" if gpu.tc["fp8"] else "weight-only"
    elif fp8_kernel in ("native", "te") and not gpu.tc["fp8"]:
        raise KernelUnavailableError(
            f"fp8 kernel {fp8_kernel!r} needs FP8 tensor cores (compute capability >= 8.9);"
            f" {gpu.name} is {gpu.sm} — use 'weight-only'"
        )
    if fp8_kernel == "te" and device == "cpu":
        raise KernelUnavailableError("fp8 kernel 'te' (transformer_engine) runs on CUDA only — use 'native' on the CPU")
    return fp8_kernel


def _draft_model_plan(
    draft_cfg: ModelConfig, fp8: bool, fp8_kernel: str, gpu: _Gpu, dt: str
) -> tuple[ModelPlan, list[str]]:
    """The draft model's plan (every family in FP8 when ``fp8``, else dense) and its note."""
    if not fp8:
        return ModelPlan("draft", dt, {f: _dense(dt) for f in FAMILIES}, _shape(draft_cfg)), []
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
    why = "FP8 tensor cores" if gpu.tc["fp8"] else "no FP8 tensor cores: FP8 storage, fp16 matmul (saves memory)"
    note = f"draft FP8 kernel {fp8_kernel!r} on {gpu.name} ({gpu.sm}: {why})"
    return ModelPlan("draft", dt, fams, _shape(draft_cfg)), [note]


def _draft_head_plan(head: tuple[Any, ...], fp8: bool, fp8_kernel: str, dt: str) -> tuple[ModelPlan, list[str]]:
    """A trained head's plan (quant.head_plan; its Linears in FP8 when ``fp8``) and its note."""
    draft = head_model_plan(*head, _fp8_family(fp8_kernel, "head") if fp8 else None, dt)
    names = [n for n, _, _ in head_linears(*head)]
    if draft.families["ffn"].quantized:
        note = (
            f"draft {head[0]} head: {', '.join(names)} in FP8 ({fp8_kernel!r}); its LM head and embedding "
            "table are the target's (verifier precision)"
        )
    else:
        note = f"draft {head[0]} head: {draft.families['ffn'].reason}"
    return draft, [note]


def _target_plan(
    target_cfg: ModelConfig, ffn_precision: str, int8: FamilyPlan, gpu: _Gpu, dt: str
) -> tuple[ModelPlan, list[str]]:
    """The target's plan: attention fp16, the FFN ``int8`` where the GPU has INT8 tensor cores and the
    precision section asks for it, the verifier's families never quantized; and its note."""
    notes: list[str] = []
    if ffn_precision == "int8" and gpu.tc["int8"]:
        ffn = int8
    elif ffn_precision == "int8":
        ffn = _dense(dt, f"{gpu.name} ({gpu.sm}) has no INT8 tensor cores: FFN kept in fp16")
        notes.append(ffn.reason)
    else:
        ffn = _dense(dt, "main_model.ffn = fp16")
    computed = "" if dt == "fp16" else f", computed in {dt}"
    families = {
        "attention": _dense("fp16", "main_model.attention = fp16" + computed),
        "ffn": ffn,
        "embeddings": _dense("fp16", "verifier = fp16" + computed),
        "lm_head": _dense("fp16", "verifier = fp16: never quantized" + computed),
        "norms": _dense(dt, "verifier: never quantized"),
    }
    return ModelPlan("target", dt, families, _shape(target_cfg)), notes


def _draft_bytes(
    draft_cfg: ModelConfig | None, draft: ModelPlan | None, head: tuple[Any, ...] | None
) -> tuple[int, int]:
    """(the draft's planned weight bytes, its fp16 weight bytes) on the GPU; (0, 0) without a draft."""
    if head is not None:  # a head keeps no KV cache; its weights only
        return head_weight_bytes(*head, draft, compute_bytes=2), head_weight_bytes(*head, None, compute_bytes=2)
    if draft is not None and draft_cfg is not None:
        return mem.weight_bytes(draft_cfg, draft, compute_bytes=2), mem.fp16_weight_bytes(draft_cfg)
    return 0, 0


# the planner's public entry point: its 9 options are keyword-only, and every caller passes them by keyword
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
    _check_options(device, int8_kernel, fp8_kernel, group_size, smoothquant_alpha, max_batch, max_seq_len)
    g = _Gpu(gpu, name, compute_capability(gpu))
    dt = "fp16" if device == "cuda" else "fp32"
    notes = _device_notes(g, device)
    fp8_kernel = _pick_fp8_kernel(fp8_kernel, g, device)
    draft = None
    if draft_cfg is not None:
        draft, more = _draft_model_plan(draft_cfg, precision["draft_model"] == "fp8", fp8_kernel, g, dt)
        notes += more
    elif head is not None:
        draft, more = _draft_head_plan(head, precision["draft_model"] == "fp8", fp8_kernel, dt)
        notes += more
    int8 = _int8_family(int8_kernel, smoothquant_alpha, group_size)
    target, more = _target_plan(target_cfg, precision["main_model"]["ffn"], int8, g, dt)
    notes += more
    cfgs = [target_cfg] + ([draft_cfg] if draft_cfg is not None else [])
    weights = (mem.weight_bytes(target_cfg, target, compute_bytes=2), mem.fp16_weight_bytes(target_cfg))
    draft_bytes = _draft_bytes(draft_cfg, draft, head)
    memory = mem.memory_plan(g.name, g.entry["memory_bytes"], cfgs, weights, draft_bytes, (max_batch, max_seq_len))
    return PrecisionPlan(
        gpu=name,
        device=device,
        compute_capability=f"{g.cc[0]}.{g.cc[1]}",
        hardware={
            "tensor_cores": dict(g.tc),
            "flash_attn_2": gpu["flash_attn_2"],
            "memory_bandwidth_gbps": gpu.get("memory_bandwidth_gbps"),
        },
        precision=precision,
        compute_dtype=dt,
        attention_backend="flash-attn-2" if gpu["flash_attn_2"] and device == "cuda" else "sdpa",
        kv_cache_dtype="fp16" if device == "cuda" else "fp32",
        verifier={"final_norm": dt, "lm_head": dt, "softmax": "fp32", "acceptance": "fp32"},
        target=target,
        draft=draft,
        memory=memory,
        notes=notes + memory.adjustments,
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
    weights = (mem.weight_bytes(target_cfg, new.target, compute_bytes=2), m.target_fp16_bytes)
    requested = (m.requested_max_batch, m.requested_max_seq_len)
    new.memory = mem.memory_plan(
        new.gpu, m.memory_bytes, cfgs, weights, (m.draft_weight_bytes, m.draft_fp16_bytes), requested
    )
    new.notes = [n for n in new.notes if n not in m.adjustments] + [note] + new.memory.adjustments
    return new
