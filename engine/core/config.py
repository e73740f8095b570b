"""Model configuration read from a Hugging Face ``config.json``.

Only the fields the Llama-family decoder needs are kept. Both the older
(``rope_theta`` + ``rope_scaling``) and the transformers-5 (``rope_parameters``)
spellings of the rotary settings are understood.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.core.errors import CheckpointError, UnsupportedArchitectureError

# architecture name in config.json -> family used by the model code
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2: always; Llama: attention_bias)
    o_bias: bool = False  # bias on o_proj (Llama attention_bias covers o too)
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def num_parameters(self, include_embeddings: bool = True) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.o_bias:
            attn += h
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        n = L * (attn + mlp + 2 * h) + h
        if include_embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], where: str = "config.json") -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPES.get(d.get("model_type", ""), d.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{where}: architecture {arch!r} is not supported; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            rope = dict(d.get("rope_parameters") or {})
            scaling = d.get("rope_scaling") or None
            if scaling is None and rope.get("rope_type", "default") != "default":
                scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            theta = float(d.get("rope_theta", rope.get("rope_theta", 10000.0)))
            if scaling is not None:
                scaling = dict(scaling)
                rtype = scaling.get("rope_type", scaling.get("type", "default"))
                if rtype not in SUPPORTED_ROPE_TYPES:
                    raise CheckpointError(
                        f"{where}: rope_scaling type {rtype!r} is not supported; "
                        f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                    )
                scaling["rope_type"] = rtype
                if rtype == "default":
                    scaling = None
            eos = d.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            window = None
            if family == "mistral":
                window = d.get("sliding_window")
            elif family == "qwen2" and d.get("use_sliding_window"):
                window = d.get("sliding_window")
            llama_bias = bool(d.get("attention_bias", False))
            return cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=True if family == "qwen2" else llama_bias,
                o_bias=llama_bias if family == "llama" else False,
                mlp_bias=bool(d.get("mlp_bias", False)),
                sliding_window=int(window) if window else None,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{where}: invalid config ({type(e).__name__}: {e})") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``model_dir/config.json``; every failure is a CheckpointError naming the path."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"{model_dir}: model directory does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path}: config.json is missing")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable config.json ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: config.json must hold a JSON object")
    cfg = ModelConfig.from_hf_dict(d, where=str(path))
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            g = json.loads(gen.read_text(encoding="utf-8"))
            eos = g.get("eos_token_id")
            if eos is not None:
                extra = [eos] if isinstance(eos, int) else list(eos)
                cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | {int(e) for e in extra})
        except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
            raise CheckpointError(f"{gen}: unreadable generation_config.json ({e})") from None
    return cfg


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype a checkpoint's config.json names (``torch_dtype``, or ``dtype`` in newer files), if any."""
    path = Path(model_dir) / "config.json"
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable config.json ({e})") from None
    v = d.get("torch_dtype", d.get("dtype")) if isinstance(d, dict) else None
    return v if isinstance(v, str) else None
