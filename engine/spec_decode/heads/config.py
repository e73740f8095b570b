"""A trained draft head's config (``head_config.json``) and the fingerprint of the target it was trained for.

The head directory (engine/spec_decode/heads/checkpoint.py writes and reads it) holds ``head_config.json``
(kind, shapes and the target's fingerprint: hidden size, vocabulary, layer count, a hash of the tokenizer's
vocabulary and probe values of its embedding) and ``model.safetensors``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.core.errors import CheckpointError, DraftMismatchError

if TYPE_CHECKING:
    from engine.core.model import Transformer

HEAD_KINDS = ("medusa", "eagle", "eagle3")  # the head architectures (heads/modules.py, heads/eagle3.py)
HEAD_CONFIG = "head_config.json"
HEAD_FORMAT = 1
PROBE_ROWS = 16  # embedding rows sampled for the target fingerprint
PROBE_COLS = 8


@dataclass(frozen=True)
class HeadConfig:
    """A head's shape and the target it was made for (``head_config.json``; published EAGLE-3 heads: built from
    their own config by engine/spec_decode/heads/eagle3_formats.py)."""

    kind: str  # "medusa" | "eagle" | "eagle3"
    hidden_size: int  # the target's
    vocab_size: int  # the target's (model) vocabulary
    layers: int = 1  # medusa: residual blocks per head; eagle: MLP blocks
    intermediate_size: int = 0  # eagle: the MLP's width (0: the hidden size)
    num_heads: int = 4  # medusa: draft positions (the most drafts per round); eagle: the unrolled depth trained
    draft_vocab: int | None = None  # size of the reduced draft vocabulary (None: the full vocabulary)
    # eagle: ``layers`` decoder layers with attention over the sequence's features (heads/eagle_attn.py) instead
    # of MLP blocks on one feature
    attention: bool = False
    attention_heads: int = 0  # with attention: query heads, key/value heads and head size (the target's)
    kv_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    # eagle3 (engine/spec_decode/heads/eagle3.py): the target layers whose entering hidden states it fuses (empty:
    # EAGLE-3's default 2, L // 2, L - 3), its fc's bias, speculators' norm_before_residual, rotary settings of
    # its own (None: the target's), whether it holds an embedding of its own (else the target's)
    feature_layers: tuple[int, ...] = ()
    fc_bias: bool = False
    norm_before_residual: bool = False
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    own_embedding: bool = False
    target: dict[str, Any] = field(default_factory=dict)  # target_fingerprint(...)
    format: int = HEAD_FORMAT

    @property
    def max_drafts(self) -> int | None:
        """The most drafts a round can use (medusa: one per head), None: no limit (eagle)."""
        return self.num_heads if self.kind == "medusa" else None


def vocab_hash(vocab: dict[str, int]) -> str:
    """sha256 of a tokenizer's vocabulary (token -> id), independent of the dict's order."""
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]


def target_fingerprint(target: Transformer, tokenizer_vocab: dict[str, int]) -> dict[str, Any]:
    """What identifies a target for a head: shapes, the tokenizer's vocabulary and probe values of
    the embedding (fixed rows, first columns; compared with a tolerance that survives fp16/bf16 loading)."""
    cfg = target.config
    w = target.embed_tokens.weight.detach()
    rows = torch.linspace(0, cfg.vocab_size - 1, PROBE_ROWS).long().to(w.device)
    probe = w[rows, :PROBE_COLS].float().cpu()
    return {
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "tokenizer_vocab_sha256": vocab_hash(tokenizer_vocab),
        "embed_probe": [round(x, 6) for x in probe.flatten().tolist()],
    }


def check_target(cfg: HeadConfig, target: Transformer, tokenizer_vocab: dict[str, int], where: str) -> None:
    """DraftMismatchError naming the first mismatch between the head's recorded target and ``target``."""
    got = target_fingerprint(target, tokenizer_vocab)
    want = cfg.target
    if cfg.hidden_size != got["hidden_size"]:
        raise DraftMismatchError(f"{where}: hidden_size {cfg.hidden_size} != the target's {got['hidden_size']}")
    if cfg.vocab_size != got["vocab_size"]:
        raise DraftMismatchError(f"{where}: vocab_size {cfg.vocab_size} != the target's {got['vocab_size']}")
    for key in ("num_hidden_layers", "tokenizer_vocab_sha256"):
        if want.get(key) != got[key]:
            raise DraftMismatchError(
                f"{where}: target.{key} {want.get(key)!r} != the target's {got[key]!r} "
                "(a head trained for another target)"
            )
    a, b = torch.tensor(want.get("embed_probe", [])), torch.tensor(got["embed_probe"])
    if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-2, atol=1e-3):
        raise DraftMismatchError(
            f"{where}: target.embed_probe differs from the target's embedding (a head trained for another target)"
        )


def is_head_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a trained head (rather than a draft model)."""
    return (Path(path) / HEAD_CONFIG).is_file()


def read_head_config(path: str | Path) -> HeadConfig:
    f = Path(path) / HEAD_CONFIG
    if not f.is_file():
        raise CheckpointError(f"{f}: head_config.json is missing (not a head directory)")
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
        raw["feature_layers"] = tuple(int(i) for i in raw.get("feature_layers", ()))
        cfg = HeadConfig(**raw)
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{f}: invalid head config ({e})") from None
    if cfg.format != HEAD_FORMAT:
        raise CheckpointError(f"{f}: format={cfg.format!r} is unsupported: allowed {HEAD_FORMAT}")
    if cfg.kind not in HEAD_KINDS:
        raise CheckpointError(f"{f}: kind={cfg.kind!r} is invalid: allowed {', '.join(HEAD_KINDS)}")
    bad_shape = min(cfg.attention_heads, cfg.kv_heads, cfg.head_dim) < 1 or cfg.head_dim % 2
    if cfg.kind == "eagle3" and bad_shape:
        raise CheckpointError(
            f"{f}: kind 'eagle3' needs attention_heads, kv_heads, head_dim >= 1 (head_dim even); got "
            f"attention_heads={cfg.attention_heads}, kv_heads={cfg.kv_heads}, head_dim={cfg.head_dim}"
        )
    if cfg.attention and (cfg.kind != "eagle" or bad_shape or cfg.attention_heads % cfg.kv_heads):
        raise CheckpointError(
            f"{f}: attention=true needs kind 'eagle' and attention_heads, kv_heads, head_dim >= 1 (heads a "
            f"multiple of kv_heads, head_dim even); got kind={cfg.kind!r}, attention_heads={cfg.attention_heads}, "
            f"kv_heads={cfg.kv_heads}, head_dim={cfg.head_dim}"
        )
    return cfg
