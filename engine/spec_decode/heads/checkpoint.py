"""Draft heads on the target's own last hidden state: Medusa heads and an EAGLE-style head.

Both read the target's *feature*: the final-norm output h_t at position t (the LM head's input,
``lm_head(h_t)`` scores the token at t + 1), which the verify pass returns beside its logits.
Both score with the target's LM head (the rows of ``vocab_ids`` only, with a reduced draft
vocabulary), so a head adds no embedding or output matrix of its own.

- ``MedusaHeads``: head i (0-based) maps h_t to a feature whose LM-head scores predict the token
  at t + 2 + i, through ``layers`` residual blocks h + SiLU(W h + b) (W = 0 at init: the identity).
  The K drafts of a round come from h of the last committed token's position, all at once.
- ``EagleHead``: autoregressive over features: (f_t, embedding of the token at t + 1) -> f_{t+1}
  (a projection of [f_t; norm(e)] to the hidden size, ``layers`` SwiGLU MLP blocks, a final RMSNorm),
  scored by the LM head. The first step reads the target's feature, later ones the head's own.

The checkpoint directory (``save_head`` / ``load_head``): ``head_config.json`` (kind, shapes and the
target's fingerprint: hidden size, vocabulary, layer count, a hash of the tokenizer's vocabulary and
probe values of its embedding) and ``model.safetensors``. ``load_head`` refuses a head of another
shape or for another target with ``DraftMismatchError`` naming the mismatch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from engine.core.errors import CheckpointError, DraftMismatchError
from engine.core.files import write_text_atomic
from engine.core.model import RMSNorm, Transformer
from engine.spec_decode.heads.eagle_attn import EagleAttnHead, head_model_config

HEAD_KINDS = ("medusa", "eagle")
HEAD_CONFIG = "head_config.json"
HEAD_FORMAT = 1
PROBE_ROWS = 16  # embedding rows sampled for the target fingerprint
PROBE_COLS = 8


@dataclass(frozen=True)
class HeadConfig:
    kind: str  # "medusa" | "eagle"
    hidden_size: int  # the target's
    vocab_size: int  # the target's (model) vocabulary
    layers: int = 1  # medusa: residual blocks per head; eagle: MLP blocks
    intermediate_size: int = 0  # eagle: the MLP's width (0: the hidden size)
    num_heads: int = 4  # medusa: draft positions (the most drafts per round); eagle: the unrolled depth trained
    draft_vocab: int | None = None  # size of the reduced draft vocabulary (None: the full vocabulary)
    # eagle: ``layers`` decoder layers with attention over the sequence's features (engine/spec_decode/heads/eagle_attn.py)
    # instead of MLP blocks on one feature
    attention: bool = False
    attention_heads: int = 0  # with attention: query heads, key/value heads and head size (the target's)
    kv_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
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


class MedusaHeads(nn.Module):
    """``num_heads`` heads of ``layers`` residual SiLU blocks each, evaluated together."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        H, M, L = cfg.hidden_size, cfg.num_heads, cfg.layers
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(L, M, H, H))  # [layer, head, out, in]: 0 -> the identity
        self.bias = nn.Parameter(torch.zeros(L, M, H))

    def kernel_weights(self) -> list[Tensor | None]:
        """The tensors of the heads' C++ step (engine/kernels/cpu_head.py): the stacked weight and bias."""
        return [self.weight, self.bias]

    def forward(self, h: Tensor, n: int | None = None) -> Tensor:
        """h [..., H] -> features [..., n, H] of the first n heads (default all)."""
        n = self.cfg.num_heads if n is None else n
        x = h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1])
        for w, b in zip(self.weight[:, :n], self.bias[:, :n]):
            x = x + F.silu(torch.einsum("...mi,moi->...mo", x, w) + b)
        return x


class EagleHead(nn.Module):
    """(feature f_t, token embedding e_{t+1}) -> f_{t+1}."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        H, inter = cfg.hidden_size, cfg.intermediate_size or cfg.hidden_size
        self.cfg = cfg
        self.embed_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.norms = nn.ModuleList(RMSNorm(H, cfg.rms_norm_eps) for _ in range(cfg.layers))
        self.gate_up = nn.ModuleList(nn.Linear(H, 2 * inter, bias=False) for _ in range(cfg.layers))
        self.down = nn.ModuleList(nn.Linear(inter, H, bias=False) for _ in range(cfg.layers))
        self.out_norm = RMSNorm(H, cfg.rms_norm_eps)

    def kernel_weights(self) -> list[Tensor | None]:
        """The tensors of the head's C++ step (engine/kernels/cpu_head.py) in its order: embed_norm, fc, per
        block norm, gate_up, down, then out_norm; None for a Linear without a plain weight (a quantized one)."""

        def w(mod: nn.Module) -> Tensor | None:
            return mod.weight if type(mod) is nn.Linear else None

        blocks = [t for n, gu, d in zip(self.norms, self.gate_up, self.down) for t in (n.weight, w(gu), w(d))]
        return [self.embed_norm.weight, w(self.fc), *blocks, self.out_norm.weight]

    def forward(self, f: Tensor, e: Tensor) -> Tensor:
        """f, e [..., H] -> the next feature [..., H]."""
        x = self.fc(torch.cat([f, self.embed_norm(e)], -1))
        for norm, gu, down in zip(self.norms, self.gate_up, self.down):
            g, u = gu(norm(x)).chunk(2, -1)
            x = x + down(F.silu(g) * u)
        return self.out_norm(x)


def draft_features(head: nn.Module, f: Tensor, emb: Tensor | None, k: int) -> Tensor:
    """The features of a round's k drafts from the target's feature f [S, H] -> [S, k, H], teacher forced:
    Medusa's first k heads at once; EAGLE chained, step j reading emb[:, j] [S, k, H], the embedding of the
    token before draft j (None for Medusa)."""
    if isinstance(head, MedusaHeads):
        return head(f, k)
    if isinstance(head, EagleAttnHead):
        raise TypeError("the EAGLE head with attention drafts over a sequence: EagleAttnHead.unrolled")
    assert emb is not None
    steps = []
    for j in range(k):
        f = head(f, emb[:, j])
        steps.append(f)
    return torch.stack(steps, 1)


def init_head(cfg: HeadConfig, target: Transformer, seed: int = 0) -> nn.Module:
    """A fresh head for ``target``: medusa at the identity, eagle with the fc near [I, 0] (f_{t+1} ~ f_t),
    small random MLPs and the output norm from the target's final norm."""
    if cfg.kind not in HEAD_KINDS:
        raise CheckpointError(f"kind={cfg.kind!r} is invalid: allowed {', '.join(HEAD_KINDS)}")
    g = torch.Generator().manual_seed(seed)
    if cfg.kind == "medusa":
        return MedusaHeads(cfg)
    if cfg.attention:
        attn = EagleAttnHead(head_model_config(target.config, cfg), cfg)
        attn.init_weights(target.norm.weight, g)
        return attn
    head = EagleHead(cfg)
    H = cfg.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.eye(H), torch.randn(H, H, generator=g) / math.sqrt(H)], 1))
        for gu, down in zip(head.gate_up, head.down):
            gu.weight.copy_(torch.randn(gu.weight.shape, generator=g) / math.sqrt(H))
            down.weight.zero_()
        head.out_norm.weight.copy_(target.norm.weight.detach().float())
    return head


def draft_lm_head(target: Transformer, vocab_ids: Tensor | None) -> nn.Linear:
    """The heads' scorer: a bias-free Linear on the target's LM head weight (shared, not copied) or, with a
    reduced draft vocabulary, on its rows ``vocab_ids`` (a copy of V' rows)."""
    w = target.lm_head.weight
    if vocab_ids is not None:
        w = nn.Parameter(w.detach()[vocab_ids].contiguous(), requires_grad=False)
    elif not isinstance(w, nn.Parameter):
        w = nn.Parameter(w.detach(), requires_grad=False)
    with torch.device("meta"):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = w
    return lin


def save_head(head: nn.Module, cfg: HeadConfig, vocab_ids: Tensor | None, out: str | Path) -> None:
    """``out``/model.safetensors and ``out``/head_config.json (written last: a directory without it is no head)."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu().contiguous().clone() for k, v in head.state_dict().items()}
    if vocab_ids is not None:
        tensors["vocab_ids"] = vocab_ids.detach().long().cpu().contiguous()
    tmp = d / f"model.safetensors.tmp-{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt", "specmix_head": cfg.kind})
    os.replace(tmp, d / "model.safetensors")
    write_text_atomic(d / HEAD_CONFIG, json.dumps(asdict(cfg), indent=2) + "\n")


def is_head_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a trained head (rather than a draft model)."""
    return (Path(path) / HEAD_CONFIG).is_file()


def read_head_config(path: str | Path) -> HeadConfig:
    f = Path(path) / HEAD_CONFIG
    if not f.is_file():
        raise CheckpointError(f"{f}: head_config.json is missing (not a head directory)")
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
        cfg = HeadConfig(**raw)
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{f}: invalid head config ({e})") from None
    if cfg.format != HEAD_FORMAT:
        raise CheckpointError(f"{f}: format={cfg.format!r} is unsupported: allowed {HEAD_FORMAT}")
    if cfg.kind not in HEAD_KINDS:
        raise CheckpointError(f"{f}: kind={cfg.kind!r} is invalid: allowed {', '.join(HEAD_KINDS)}")
    bad_shape = min(cfg.attention_heads, cfg.kv_heads, cfg.head_dim) < 1 or cfg.head_dim % 2
    if cfg.attention and (cfg.kind != "eagle" or bad_shape or cfg.attention_heads % cfg.kv_heads):
        raise CheckpointError(
            f"{f}: attention=true needs kind 'eagle' and attention_heads, kv_heads, head_dim >= 1 (heads a "
            f"multiple of kv_heads, head_dim even); got kind={cfg.kind!r}, attention_heads={cfg.attention_heads}, "
            f"kv_heads={cfg.kv_heads}, head_dim={cfg.head_dim}"
        )
    return cfg


def load_head(
    path: str | Path, target: Transformer, tokenizer_vocab: dict[str, int], kind: str | None = None
) -> tuple[nn.Module, HeadConfig, Tensor | None]:
    """(head on the target's device and dtype, its config, vocab_ids or None), checked against ``target``.

    ``kind``: the drafter asked for ("medusa" | "eagle"); a head of the other kind is refused."""
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
