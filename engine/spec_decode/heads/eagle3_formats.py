"""Loading EAGLE-3 heads: specmix's own, the EAGLE authors' layout (also SpecForge's) and vLLM ``speculators``'.

Which layout a directory holds (docs/design.md, "EAGLE-3 heads"):

- specmix: ``head_config.json`` (kind ``eagle3``, the target's fingerprint) and ``model.safetensors``;
- the EAGLE authors' / SpecForge: ``config.json`` with ``architectures`` ``["LlamaForCausalLMEagle3"]`` (a Llama
  config of the one layer: ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
  ``intermediate_size``, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling``, ``vocab_size`` (the target's),
  ``draft_vocab_size``, optional ``target_hidden_size``) and ``model.safetensors`` or ``pytorch_model.bin``;
- speculators: ``config.json`` with ``speculators_model_type: "eagle3"``, ``transformer_layer_config`` (that
  Llama config), ``draft_vocab_size``, ``norm_before_residual``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` and ``speculators_config`` (``algorithm``, ``proposal_methods``
  [{``proposal_type``, ``speculative_tokens``}], ``verifier`` {``name_or_path``, ``architectures``}); its
  weights name the layer ``layers.0.*`` where the authors' say ``midlayer.*``.

Weights: ``fc.weight`` (+ ``fc.bias``), ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t`` (draft id -> target id offset), ``t2d`` (the target's ids in the draft vocabulary),
optional ``embed_tokens.weight``. A head whose hidden size, vocabulary or feature layers do not fit the target is
refused with ``DraftMismatchError`` naming both values.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from engine.core.config import ModelConfig
from engine.core.errors import CheckpointError, DraftMismatchError
from engine.core.model import Transformer
from engine.spec_decode.heads.config import HEAD_CONFIG, HeadConfig, check_target, read_head_config
from engine.spec_decode.heads.eagle3 import Eagle3Head, default_feature_layers, eagle3_model_config

log = logging.getLogger(__name__)

AUTHORS_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def load_eagle3(
    path: str | Path, target: Transformer, tokenizer_vocab: dict[str, int]
) -> tuple[Eagle3Head, HeadConfig, Tensor | None]:
    """(the head on the target's device and dtype, its config, its draft vocabulary's target ids or None) from
    any of the three layouts, checked against ``target``."""
    d = Path(path)
    if (d / HEAD_CONFIG).is_file():
        cfg = read_head_config(d)
        where = str(d / HEAD_CONFIG)
        if cfg.kind != "eagle3":
            raise DraftMismatchError(f"{where}: kind={cfg.kind!r}, but the drafter is 'eagle3'")
        check_target(cfg, target, tokenizer_vocab, where)
        weights = d / "model.safetensors"
        tensors = _read_weights(d)
    else:
        raw, where = _read_json(d / "config.json")
        cfg = _published_config(raw, target, where)
        tensors = _read_weights(d)
        weights = d / ("model.safetensors" if (d / "model.safetensors").is_file() else "pytorch_model.bin")
        tensors = {
            ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v for k, v in tensors.items()
        }
        cfg = _with_weights(cfg, tensors)
    layers = cfg.feature_layers or default_feature_layers(target.config.num_hidden_layers)
    n = target.config.num_hidden_layers
    if any(not 0 <= i < n for i in layers):
        raise DraftMismatchError(f"{where}: feature layers {list(layers)} lie outside the target's {n} layers")
    cfg = replace(cfg, feature_layers=tuple(layers))
    vocab_ids = _vocab_ids(tensors.pop("d2t", None), tensors.pop("t2d", None), cfg, weights)
    head = Eagle3Head(eagle3_model_config(target.config, cfg), cfg, 3 * target.config.hidden_size)
    want = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    for k in sorted(set(want) | set(got)):
        if want.get(k) != got.get(k):
            raise DraftMismatchError(f"{weights}: tensor {k} has shape {got.get(k)}, the config needs {want.get(k)}")
    head.load_state_dict({k: v.float() for k, v in tensors.items()})
    w = target.norm.weight
    head.to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)
    return head, cfg, None if vocab_ids is None else vocab_ids.to(w.device)


def is_published_eagle3(path: str | Path) -> bool:
    """Whether ``path`` holds an EAGLE-3 head in the EAGLE authors' / SpecForge or the speculators layout."""
    f = Path(path) / "config.json"
    try:
        raw = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(raw, dict):
        return False
    archs = raw.get("architectures")
    authors = isinstance(archs, list) and any(a in AUTHORS_ARCHITECTURES for a in archs)
    return authors or raw.get("speculators_model_type") == "eagle3"


def _authors_name(key: str) -> str:
    """speculators' ``layers.0.*`` -> the authors' ``midlayer.*``; other names as they are."""
    return "midlayer." + key[len("layers.0.") :] if key.startswith("layers.0.") else key


def _read_json(f: Path) -> tuple[dict[str, Any], str]:
    if not f.is_file():
        raise CheckpointError(f"{f.parent}: neither {HEAD_CONFIG} nor config.json (not an EAGLE-3 head directory)")
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{f}: not a JSON object")
    return raw, str(f)


def _read_weights(d: Path) -> dict[str, Tensor]:
    """model.safetensors, else pytorch_model.bin (tensors only: ``weights_only``)."""
    st, pt = d / "model.safetensors", d / "pytorch_model.bin"
    try:
        if st.is_file():
            return load_file(str(st))
        if pt.is_file():
            obj = torch.load(pt, map_location="cpu", weights_only=True)
            if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
                raise CheckpointError(f"{pt}: not a state dict of tensors")
            return dict(obj)
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{d}: cannot read the weights ({e})") from None
    raise CheckpointError(f"{d}: neither model.safetensors nor pytorch_model.bin")


def _int(raw: dict[str, Any], key: str, where: str) -> int:
    v = raw.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise CheckpointError(f"{where}: {key}={v!r} is invalid: allowed an int >= 1")
    return v


def _published_config(raw: dict[str, Any], target: Transformer, where: str) -> HeadConfig:
    """The HeadConfig of an EAGLE authors' or speculators config, its shapes checked against the target's."""
    spec = raw.get("speculators_model_type")
    archs = raw.get("architectures") or []
    if spec is not None:
        if spec != "eagle3":
            raise CheckpointError(f"{where}: speculators_model_type={spec!r} is unsupported: allowed 'eagle3'")
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise CheckpointError(f"{where}: transformer_layer_config is missing or not an object")
        _log_speculators(raw.get("speculators_config"), target, where)
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        norm_before = raw.get("norm_before_residual", False)
    elif any(a in AUTHORS_ARCHITECTURES for a in archs if isinstance(a, str)):
        ec = raw.get("eagle_config")
        aux = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
        layer, norm_before = raw, False
    else:
        raise CheckpointError(
            f"{where}: architectures={archs!r} without speculators_model_type: allowed an EAGLE-3 head "
            f"({', '.join(AUTHORS_ARCHITECTURES)}, or speculators_model_type 'eagle3')"
        )
    mcfg = ModelConfig.from_hf_dict({**layer, "architectures": ["LlamaForCausalLM"]}, where)
    tcfg = target.config
    th = raw.get("target_hidden_size", layer.get("target_hidden_size")) or mcfg.hidden_size
    for name, got, want in (
        ("hidden_size", mcfg.hidden_size, tcfg.hidden_size),
        ("target_hidden_size", th, tcfg.hidden_size),
        ("vocab_size", mcfg.vocab_size, tcfg.vocab_size),
    ):
        if got != want:
            raise DraftMismatchError(f"{where}: the head's {name} {got} != the target's {want}")
    if aux is not None:
        if not isinstance(aux, list) or len(aux) != 3 or not all(isinstance(i, int) for i in aux):
            raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids={aux!r}: allowed 3 layer indices")
        if max(aux) >= tcfg.num_hidden_layers or min(aux) < 0:
            raise DraftMismatchError(
                f"{where}: eagle_aux_hidden_state_layer_ids {aux} needs a verifier of more than {max(aux)} layers; "
                f"the target has {tcfg.num_hidden_layers}"
            )
    draft_vocab = raw.get("draft_vocab_size", layer.get("draft_vocab_size")) or mcfg.vocab_size
    _int({"draft_vocab_size": draft_vocab}, "draft_vocab_size", where)
    return HeadConfig(
        kind="eagle3",
        hidden_size=mcfg.hidden_size,
        vocab_size=mcfg.vocab_size,
        intermediate_size=mcfg.intermediate_size,
        num_heads=5,
        draft_vocab=None if draft_vocab == mcfg.vocab_size else draft_vocab,
        attention_heads=mcfg.num_attention_heads,
        kv_heads=mcfg.num_key_value_heads,
        head_dim=mcfg.head_dim,
        rms_norm_eps=mcfg.rms_norm_eps,
        feature_layers=() if aux is None else tuple(aux),
        norm_before_residual=bool(norm_before),
        rope_theta=mcfg.rope_theta,
        rope_scaling=mcfg.rope_scaling,
    )


def _log_speculators(sc: Any, target: Transformer, where: str) -> None:
    """What ``speculators_config`` names (the verifier, the proposal method), logged: the checks are the shapes'."""
    if not isinstance(sc, dict):
        raise CheckpointError(f"{where}: speculators_config is missing or not an object")
    verifier = sc.get("verifier") if isinstance(sc.get("verifier"), dict) else {}
    archs = verifier.get("architectures") or []
    if archs and target.config.architecture not in archs:
        log.warning("%s: verifier architectures %s, the target is %s", where, archs, target.config.architecture)
    log.info("%s: verifier %r, proposal methods %r", where, verifier.get("name_or_path"), sc.get("proposal_methods"))


def _with_weights(cfg: HeadConfig, tensors: dict[str, Tensor]) -> HeadConfig:
    """What the config leaves to the weights: the fc's bias, an embedding of the head's own."""
    return replace(cfg, fc_bias="fc.bias" in tensors, own_embedding="embed_tokens.weight" in tensors)


def _vocab_ids(d2t: Tensor | None, t2d: Tensor | None, cfg: HeadConfig, weights: Path) -> Tensor | None:
    """The target ids of the draft vocabulary, arange(V') + d2t, checked (in the vocabulary, distinct, as t2d)."""
    if d2t is None:
        if cfg.draft_vocab is not None:
            raise DraftMismatchError(f"{weights}: draft_vocab_size={cfg.draft_vocab} but the weights hold no d2t")
        return None
    n, V = cfg.draft_vocab or cfg.vocab_size, cfg.vocab_size
    if d2t.dim() != 1 or len(d2t) != n or d2t.dtype.is_floating_point:
        raise DraftMismatchError(f"{weights}: d2t has shape {tuple(d2t.shape)} ({d2t.dtype}); needs [{n}] int")
    ids = torch.arange(n) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= V or len(ids.unique()) != n:
        raise DraftMismatchError(f"{weights}: d2t maps draft ids outside 0..{V - 1} or twice onto one target id")
    if t2d is not None:
        if t2d.shape != (V,) or int(t2d.bool().sum()) != n or not bool(t2d.bool()[ids].all()):
            raise DraftMismatchError(f"{weights}: t2d (shape {tuple(t2d.shape)}) disagrees with d2t's {n} target ids")
    return None if n == V and bool((ids == torch.arange(V)).all()) else ids
