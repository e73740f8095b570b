"""A trained draft head's directory: ``save_head`` writes it, ``load_head`` reads it for a target.

``head_config.json`` (engine/spec_decode/heads/config.py; written last) and ``model.safetensors``; ``load_head``
refuses a head of another shape or for another target with ``DraftMismatchError`` naming the mismatch.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from engine.core.errors import CheckpointError, DraftMismatchError
from engine.core.files import write_checkpoint_files
from engine.core.model import Transformer
from engine.spec_decode.heads.config import HEAD_CONFIG, HeadConfig, check_target, read_head_config
from engine.spec_decode.heads.modules import init_head


def save_head(head: nn.Module, cfg: HeadConfig, vocab_ids: Tensor | None, out: str | Path) -> None:
    """``out``/model.safetensors, then ``out``/head_config.json: a directory whose config is there holds the
    weights it describes (``write_checkpoint_files``: the weights are written to a temp file, the old config
    removed, the weights renamed into place, the config written last)."""
    tensors = {k: v.detach().float().cpu().contiguous().clone() for k, v in head.state_dict().items()}
    if vocab_ids is not None and cfg.kind == "eagle3":  # EAGLE-3's mapping (heads/eagle3_formats.py reads it)
        ids = vocab_ids.detach().long().cpu()
        tensors["d2t"] = (ids - torch.arange(len(ids))).contiguous()
        tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    elif vocab_ids is not None:
        tensors["vocab_ids"] = vocab_ids.detach().long().cpu().contiguous()
    meta = {"format": "pt", "specmix_head": cfg.kind}
    write_checkpoint_files(
        Path(out),
        {"model.safetensors": lambda p: save_file(tensors, str(p), metadata=meta)},
        HEAD_CONFIG,
        json.dumps(asdict(cfg), indent=2) + "\n",
    )


def load_head(
    path: str | Path, target: Transformer, tokenizer_vocab: dict[str, int], kind: str | None = None
) -> tuple[nn.Module, HeadConfig, Tensor | None]:
    """(head on the target's device and dtype, its config, vocab_ids or None), checked against ``target``.

    ``kind``: the drafter asked for ("medusa" | "eagle" | "eagle3"); a head of another kind is refused. EAGLE-3
    heads load from the published layouts too (heads/eagle3_formats.py)."""
    if kind == "eagle3":
        from engine.spec_decode.heads.eagle3_formats import load_eagle3

        return load_eagle3(path, target, tokenizer_vocab)
    cfg = read_head_config(path)
    where = str(Path(path) / HEAD_CONFIG)
    if kind is not None and cfg.kind != kind:
        raise DraftMismatchError(f"{where}: kind={cfg.kind!r}, but the drafter is {kind!r}")
    check_target(cfg, target, tokenizer_vocab, where)
    try:
        tensors = load_file(str(Path(path) / "model.safetensors"))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{Path(path) / 'model.safetensors'}: cannot read ({e})") from None
    vocab_ids = tensors.pop("vocab_ids", None)
    head = init_head(cfg, target)
    want = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    for k in sorted(set(want) | set(got)):
        if want.get(k) != got.get(k):
            raise DraftMismatchError(
                f"{Path(path) / 'model.safetensors'}: tensor {k} has shape {got.get(k)}, "
                f"the config ({HEAD_CONFIG}) needs {want.get(k)}"
            )
    if vocab_ids is not None:
        bad = (
            vocab_ids.dim() != 1
            or len(vocab_ids) != cfg.draft_vocab
            or len(vocab_ids) == 0
            or int(vocab_ids.min()) < 0
            or int(vocab_ids.max()) >= cfg.vocab_size
        )
        if bad:
            raise DraftMismatchError(
                f"{Path(path) / 'model.safetensors'}: vocab_ids must hold draft_vocab="
                f"{cfg.draft_vocab} ids in 0..{cfg.vocab_size - 1}"
            )
    elif cfg.draft_vocab is not None:
        raise DraftMismatchError(f"{where}: draft_vocab={cfg.draft_vocab} but the weights hold no vocab_ids")
    head.load_state_dict(tensors)
    w = target.norm.weight
    head.to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)
    return head, cfg, None if vocab_ids is None else vocab_ids.to(w.device)
