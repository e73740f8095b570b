"""Loading Hugging Face checkpoint directories into ``engine.core.model.Transformer``.

The model is built on the meta device and the safetensors tensors are assigned
in place (memory-mapped reads, one conversion per tensor), so a checkpoint is
never held twice; vectors are copied, so the map outlives no matrix that reads
it. Every failure is a CheckpointError naming the path and cause.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.core.config import ModelConfig, load_config
from engine.core.errors import CheckpointError
from engine.core.model import Transformer

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: model.safetensors or the shards of its index."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d}: model directory does not exist")
    single, index = d / "model.safetensors", d / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(wmap.values()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: invalid safetensors index ({e})") from None
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
        return [d / f for f in files]
    raise CheckpointError(f"{d}: no weights found (expected model.safetensors or model.safetensors.index.json)")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype={dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    config: ModelConfig | None = None,
) -> Transformer:
    """Build the model on the meta device and assign the checkpoint's tensors."""
    dtype = resolve_dtype(dtype)
    cfg = config or load_config(model_dir)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {k: v for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = key[len("model.") :] if key.startswith("model.") else key
                    if name not in expected:
                        if name == "lm_head.weight" and cfg.tie_word_embeddings:
                            continue
                        log.debug("%s: ignoring tensor %s", path, key)
                        continue
                    t = f.get_tensor(key)
                    want = tuple(expected[name].shape)
                    if tuple(t.shape) != want:
                        raise CheckpointError(f"{path}: tensor {key} has shape {tuple(t.shape)}, expected {want}")
                    # vectors (norms, biases) are copied out of the file's memory map, so the map lives only as
                    # long as the matrices reading it (a precision plan that replaces them all releases it)
                    state[name] = t.to(device=device, dtype=dtype, copy=t.dim() < 2)
        except SafetensorError as e:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from None
        except OSError as e:
            raise CheckpointError(f"{path}: unreadable weight file ({e})") from None
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{model_dir}: missing tensor(s) {', '.join(missing[:5])}{more}")
    model.load_state_dict(state, strict=True, assign=True) if not cfg.tie_word_embeddings else model.load_state_dict(
        state, strict=False, assign=True
    )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope()
    model.eval().requires_grad_(False)
    return model
