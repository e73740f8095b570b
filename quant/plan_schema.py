"""The precision plan's data: its dataclasses (written to and read from profiles by quant.plan_io),
their vocabulary (families, storage formats, schema version) and the precision section of the
config (docs/design.md, the precision plan): ``DEFAULT_PRECISION`` and ``validate_precision``.
``quant.plan.make_plan`` fills these in.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.core.errors import InvalidConfigError
from engine.core.files import write_text_atomic

PLAN_SCHEMA_VERSION = 1
DEFAULT_PRECISION: dict[str, Any] = {
    "draft_model": "fp8",
    "main_model": {"attention": "fp16", "ffn": "int8"},
    "verifier": "fp16",
}
FAMILIES = ("attention", "ffn", "embeddings", "lm_head", "norms")
HEAD_KINDS = ("medusa", "eagle", "eagle3")  # a draft part planned for a trained head (ModelPlan.head)
FAMILY_MODULES = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "ffn": ("gate_proj", "up_proj", "down_proj")}
DENSE_STORAGE = ("fp32", "fp16", "bf16")
STORAGE = DENSE_STORAGE + ("fp8_e4m3", "int8")
_PRECISION_ALLOWED = {
    "draft_model": ("fp8", "fp16"),
    "attention": ("fp16",),
    "ffn": ("int8", "fp16"),
    "verifier": ("fp16",),
}


@dataclass
class FamilyPlan:
    storage: str  # one of STORAGE
    kernel: str  # "dense" for dense storage; an fp8 / int8 kernel name otherwise
    scaling: dict[str, Any] = field(default_factory=dict)
    reason: str = ""

    @property
    def quantized(self) -> bool:
        return self.storage not in DENSE_STORAGE


@dataclass
class ModelPlan:
    role: str  # "target" | "draft"
    compute_dtype: str
    families: dict[str, FamilyPlan]
    model: dict[str, Any]  # shape of the model the plan was made for (checked at apply)
    modules: dict[str, FamilyPlan] = field(default_factory=dict)  # per-layer overrides by module name
    # the draft is a trained head of this kind (one of HEAD_KINDS, quant.head_plan), not a model: ``model`` holds
    # the head's shape and the ``ffn`` family its Linears; None for a model
    head: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def module_plan(self, name: str, family: str) -> FamilyPlan:
        """The plan of one Linear (``layers.3.mlp.up_proj``): its override, else its family's."""
        return self.modules.get(name, self.families[family])

    def all_plans(self) -> list[FamilyPlan]:
        return list(self.families.values()) + list(self.modules.values())


@dataclass
class MemoryPlan:
    memory_bytes: int
    budget_fraction: float
    budget_bytes: int
    target_weight_bytes: int
    target_fp16_bytes: int
    draft_weight_bytes: int
    draft_fp16_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    workspace_bytes: int
    workspace_formula: str
    total_bytes: int
    max_batch: int
    max_seq_len: int
    requested_max_batch: int
    requested_max_seq_len: int
    adjustments: list[str] = field(default_factory=list)


@dataclass
class PrecisionPlan:
    gpu: str
    device: str  # "cuda" | "cpu"
    compute_capability: str
    hardware: dict[str, Any]
    precision: dict[str, Any]
    compute_dtype: str
    attention_backend: str
    kv_cache_dtype: str
    verifier: dict[str, str]
    """The arithmetic dtype of each verifier part (final_norm, lm_head, softmax, acceptance); the storage of the
    target's embeddings and LM head is ``target.families`` (fp16: the precision section's ``verifier``)."""
    target: ModelPlan
    draft: ModelPlan | None
    memory: MemoryPlan
    notes: list[str] = field(default_factory=list)
    schema_version: int = PLAN_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def save(self, path: str | Path) -> None:
        """Write atomically (engine/core/files.py: a temp file beside it, then a rename)."""
        write_text_atomic(Path(path), self.to_json() + "\n")


def validate_precision(precision: Any) -> dict[str, Any]:
    """The precision section, exactly the shape in docs/design.md; bad fields name themselves."""
    if not isinstance(precision, dict):
        raise InvalidConfigError(f"precision must be an object like {json.dumps(DEFAULT_PRECISION)}")
    extra = set(precision) - {"draft_model", "main_model", "verifier"}
    if extra:
        raise InvalidConfigError(
            f"precision.{sorted(extra)[0]} is not a field; allowed: draft_model, main_model, verifier"
        )
    main = precision.get("main_model")
    if not isinstance(main, dict) or set(main) != {"attention", "ffn"}:
        raise InvalidConfigError(f"precision.main_model={main!r} is invalid: allowed an object with attention and ffn")
    for name, value in (
        ("draft_model", precision.get("draft_model")),
        ("main_model.attention", main["attention"]),
        ("main_model.ffn", main["ffn"]),
        ("verifier", precision.get("verifier")),
    ):
        allowed = _PRECISION_ALLOWED[name.split(".")[-1]]
        if value not in allowed:
            raise InvalidConfigError(f"precision.{name}={value!r} is invalid: allowed {', '.join(allowed)}")
    return copy.deepcopy(precision)
