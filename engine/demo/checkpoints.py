"""Saving a demo model as a Hugging Face checkpoint directory (safetensors, tokenizer files, config last)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.core.config import ModelConfig
from engine.core.files import write_checkpoint_files
from engine.core.model import Transformer
from engine.demo.recipe import EOS_TOKEN


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json for transformers' LlamaForCausalLM (and engine.core.config.load_config); ``dtype``: the
    weights' dtype on disk."""
    eos = cfg.eos_token_ids[0]
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": None,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def save_checkpoint(model: Transformer, tok: Any, out: Path, dtype: torch.dtype = torch.float32) -> None:
    """An HF directory: model.safetensors ("model."-prefixed, weights in ``dtype``), tokenizer files,
    generation_config, and config.json written last (``write_checkpoint_files``: a directory whose config is
    there holds complete files)."""
    cfg = model.config
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        key = name if name.startswith("lm_head.") else f"model.{name}"
        tensors[key] = t.detach().to("cpu", dtype).contiguous().clone()
    eos = cfg.eos_token_ids[0]
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
    }
    files: dict[str, Callable[[Path], Any]] = {
        "model.safetensors": lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
        "generation_config.json": _json_writer({"bos_token_id": cfg.bos_token_id, "eos_token_id": eos}),
        "tokenizer.json": lambda p: tok.save(str(p)),
        "tokenizer_config.json": _json_writer(tok_cfg),
        "special_tokens_map.json": _json_writer({"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN}),
    }
    write_checkpoint_files(out, files, "config.json", _json_text(hf_config(cfg, dtype)))


def _json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2) + "\n"


def _json_writer(obj: Any) -> Callable[[Path], None]:
    return lambda path: path.write_text(_json_text(obj), encoding="utf-8")
