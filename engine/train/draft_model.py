"""A draft model's shape for a target and its checkpoint (train-draft's kind "model": engine/train/distill.py)."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from engine.core.files import write_checkpoint_files


def draft_model_config(target_cfg: Any, layers: int, hidden: int) -> Any:
    heads = max(1, hidden // 64)
    return replace(
        target_cfg,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        tie_word_embeddings=True,
    )


def save_draft_model(draft: nn.Module, target_dir: Path, out: Path) -> None:
    """A Hugging Face checkpoint: the target's tokenizer files, the weights, and config.json with the draft's
    shape written last (``write_checkpoint_files``: a directory whose config is there holds complete files)."""
    from safetensors.torch import save_file

    tensors = {
        ("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v.detach().float().cpu().contiguous().clone()
        for k, v in draft.state_dict().items()
        if k != "lm_head.weight"
    }
    files: dict[str, Callable[[Path], Any]] = {
        name: functools.partial(shutil.copyfile, target_dir / name)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
        if (target_dir / name).is_file()
    }
    files["model.safetensors"] = lambda p: save_file(tensors, str(p), metadata={"format": "pt"})
    raw = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    c = draft.config
    raw.pop("quantization_config", None)
    raw.update(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    write_checkpoint_files(out, files, "config.json", json.dumps(raw, indent=2) + "\n")
