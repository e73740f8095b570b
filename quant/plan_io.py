"""Reading a PrecisionPlan back: from its JSON data, text or file, refusing bad fields by name (ProfileError)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from engine.core.errors import InvalidConfigError, ProfileError

from .matmul_kernels import FP8_KERNELS, INT8_KERNELS
from .plan_schema import (
    DENSE_STORAGE,
    FAMILIES,
    FAMILY_MODULES,
    HEAD_KINDS,
    PLAN_SCHEMA_VERSION,
    STORAGE,
    FamilyPlan,
    MemoryPlan,
    ModelPlan,
    PrecisionPlan,
    validate_precision,
)

_KERNELS_BY_STORAGE = {**{s: ("dense",) for s in DENSE_STORAGE}, "fp8_e4m3": FP8_KERNELS, "int8": INT8_KERNELS}


def _need(d: dict[str, Any], key: str, where: str, typ: type | tuple[type, ...]) -> Any:
    if key not in d:
        raise ProfileError(f"{where}.{key} is missing")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise ProfileError(f"{where}.{key}={v!r} is invalid: allowed {names}")
    return v


def _choice(value: Any, where: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ProfileError(f"{where}={value!r} is invalid: allowed {', '.join(allowed)}")
    return value


def _family(d: Any, where: str, role: str, name: str) -> FamilyPlan:
    if not isinstance(d, dict):
        raise ProfileError(f"{where} must be an object with storage, kernel, scaling")
    storage = _choice(d.get("storage"), f"{where}.storage", STORAGE)
    if role == "target" and name in ("lm_head", "norms") and storage not in DENSE_STORAGE:
        raise ProfileError(
            f"{where}.storage={storage!r} is invalid: the verifier's {name} is never quantized; "
            f"allowed {', '.join(DENSE_STORAGE)}"
        )
    if name == "norms" and storage not in DENSE_STORAGE:
        raise ProfileError(f"{where}.storage={storage!r} is invalid: norms are never quantized")
    if name in ("embeddings", "lm_head") and storage == "int8":
        raise ProfileError(f"{where}.storage='int8' is invalid: allowed {', '.join(DENSE_STORAGE)}, fp8_e4m3")
    allowed = ("weight-only",) if name == "embeddings" and storage == "fp8_e4m3" else _KERNELS_BY_STORAGE[storage]
    kernel = _choice(d.get("kernel"), f"{where}.kernel", allowed)
    scaling = d.get("scaling", {})
    if not isinstance(scaling, dict):
        raise ProfileError(f"{where}.scaling={scaling!r} is invalid: allowed an object")
    alpha = scaling.get("smoothquant_alpha")
    if alpha is not None and (not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0):
        raise ProfileError(f"{where}.scaling.smoothquant_alpha={alpha!r} is invalid: allowed 0.0 .. 1.0 or null")
    g = scaling.get("group_size")
    if g is not None and (kernel != "w8a16" or not isinstance(g, int) or isinstance(g, bool) or g < 1):
        raise ProfileError(
            f"{where}.scaling.group_size={g!r} is invalid with kernel {kernel!r}: allowed an "
            "integer >= 1 with kernel 'w8a16', else null"
        )
    return FamilyPlan(storage, kernel, dict(scaling), str(d.get("reason", "")))


def _modules(d: Any, where: str, role: str, layers: Any) -> dict[str, FamilyPlan]:
    """Per-layer overrides: ``layers.<i>.self_attn.<q|k|v|o>_proj`` or ``layers.<i>.mlp.<gate|up|down>_proj``."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ProfileError(f"{where} must be an object mapping module names to plans")
    out = {}
    for name, fam_d in d.items():
        parts = str(name).split(".")
        part_fam = {"self_attn": "attention", "mlp": "ffn"}
        ok = (
            len(parts) == 4
            and parts[0] == "layers"
            and parts[1].isdigit()
            and parts[2] in part_fam
            and parts[3] in FAMILY_MODULES[part_fam[parts[2]]]
            and (not isinstance(layers, int) or int(parts[1]) < layers)
        )
        if not ok:
            raise ProfileError(
                f"{where}.{name} is not a module of the model: allowed layers.<0..{layers}>."
                "self_attn.<q|k|v|o>_proj or layers.<i>.mlp.<gate|up|down>_proj"
            )
        out[name] = _family(fam_d, f"{where}.{name}", role, part_fam[parts[2]])
    return out


def _model(d: Any, where: str, role: str) -> ModelPlan:
    if not isinstance(d, dict):
        raise ProfileError(f"{where} must be an object")
    dt = _choice(d.get("compute_dtype"), f"{where}.compute_dtype", DENSE_STORAGE)
    fams = _need(d, "families", where, dict)
    missing = [f for f in FAMILIES if f not in fams]
    if missing:
        raise ProfileError(f"{where}.families.{missing[0]} is missing; required: {', '.join(FAMILIES)}")
    families = {f: _family(fams[f], f"{where}.families.{f}", role, f) for f in FAMILIES}
    shape = _need(d, "model", where, dict)
    if shape.get("tie_word_embeddings") and families["lm_head"].storage != families["embeddings"].storage:
        raise ProfileError(
            f"{where}.families.lm_head.storage={families['lm_head'].storage!r} differs from the "
            f"tied embeddings' {families['embeddings'].storage!r}"
        )
    if d.get("role") != role:
        raise ProfileError(f"{where}.role={d.get('role')!r} is invalid: allowed {role!r}")
    modules = _modules(d.get("modules"), f"{where}.modules", role, shape.get("num_hidden_layers"))
    head = d.get("head")
    if head is not None and (role != "draft" or head not in HEAD_KINDS):
        allowed = f"{', '.join(HEAD_KINDS)} or null" if role == "draft" else "null (the target is no head)"
        raise ProfileError(f"{where}.head={head!r} is invalid: allowed {allowed}")
    if head is not None and (modules or families["lm_head"].quantized or families["embeddings"].quantized):
        raise ProfileError(
            f"{where}: a plan for a {head} head quantizes only its own Linears (families.ffn): the LM head and "
            "embeddings are the target's, and it has no per-layer modules"
        )
    return ModelPlan(role, dt, families, dict(shape), modules, head)


def plan_from_dict(d: Any) -> PrecisionPlan:
    where = "plan"
    if not isinstance(d, dict):
        raise ProfileError(f"{where} must be a JSON object")
    version = d.get("schema_version")
    if version != PLAN_SCHEMA_VERSION:
        raise ProfileError(f"{where}.schema_version={version!r} is not supported; supported: {PLAN_SCHEMA_VERSION}")
    try:
        precision = validate_precision(d.get("precision"))
    except InvalidConfigError as e:
        raise ProfileError(f"{where}: {e}") from None
    device = _choice(d.get("device"), f"{where}.device", ("cuda", "cpu"))
    mem_d = _need(d, "memory", where, dict)
    mem_kw: dict[str, Any] = {}
    for f in fields(MemoryPlan):
        if f.name == "adjustments":
            mem_kw[f.name] = list(mem_d.get("adjustments", []))
        elif f.name == "workspace_formula":
            mem_kw[f.name] = str(_need(mem_d, f.name, f"{where}.memory", str))
        elif f.name == "budget_fraction":
            mem_kw[f.name] = float(_need(mem_d, f.name, f"{where}.memory", (int, float)))
        else:
            mem_kw[f.name] = _need(mem_d, f.name, f"{where}.memory", int)
    for key in ("max_batch", "max_seq_len"):
        if mem_kw[key] < 1:
            raise ProfileError(f"{where}.memory.{key}={mem_kw[key]!r} is invalid: allowed >= 1")
    draft_d = d.get("draft")
    return PrecisionPlan(
        gpu=_need(d, "gpu", where, str),
        device=device,
        compute_capability=_need(d, "compute_capability", where, str),
        hardware=dict(_need(d, "hardware", where, dict)),
        precision=precision,
        compute_dtype=_choice(d.get("compute_dtype"), f"{where}.compute_dtype", DENSE_STORAGE),
        attention_backend=_choice(d.get("attention_backend"), f"{where}.attention_backend", ("flash-attn-2", "sdpa")),
        kv_cache_dtype=_choice(d.get("kv_cache_dtype"), f"{where}.kv_cache_dtype", DENSE_STORAGE),
        verifier=dict(_need(d, "verifier", where, dict)),
        target=_model(d.get("target"), f"{where}.target", "target"),
        draft=None if draft_d is None else _model(draft_d, f"{where}.draft", "draft"),
        memory=MemoryPlan(**mem_kw),
        notes=[str(n) for n in d.get("notes", [])],
        schema_version=version,
    )


def plan_from_json(text: str) -> PrecisionPlan:
    """A plan from its JSON text (``PrecisionPlan.to_json``)."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"plan: invalid JSON ({e})") from None
    return plan_from_dict(d)


def load_plan(path: str | Path) -> PrecisionPlan:
    """A plan from a file written by ``PrecisionPlan.save``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: unreadable plan ({e})") from None
    return plan_from_json(text)
