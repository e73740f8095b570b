"""Saving a demo model as a Hugging Face checkpoint directory (config, safetensors, tokenizer files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.core.config import ModelConfig
from engine.core.model import Transformer
from engine.demo.recipe import EOS_TOKEN


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for transformers' LlamaForCausalLM (and engine.core.config.load_config)."""
    eos = cfg.eos_token_ids[0]
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
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def save_checkpoint(model: Transformer, tok: Any, out: Path) -> None:
    """An HF directory: config.json, model.safetensors ("model."-prefixed), tokenizer files, generation_config."""
    cfg = model.config
    out.mkdir(parents=True)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        key = name if name.startswith("lm_head.") else f"model.{name}"
        tensors[key] = t.detach().to(torch.float32).contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", hf_config(cfg))
    eos = cfg.eos_token_ids[0]
    _write_json(out / "generation_config.json", {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos})
    tok.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": EOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "unk_token": None,
            "add_bos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": cfg.max_position_embeddings,
        },
    )
    _write_json(out / "special_tokens_map.json", {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN})


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
