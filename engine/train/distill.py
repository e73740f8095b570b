"""Training a draft for any target: a small draft model, Medusa heads or an EAGLE-style head.

``train_draft(target_dir, out, opts, text)``: the target generates text from prompts cut out of
``text`` (engine/train/data.py), then the draft learns the target's soft labels on it:
KL(target || draft) over the target's top-k tokens plus one bucket for the rest of the vocabulary
(with a reduced draft vocabulary the top-k tokens outside it count toward that bucket), mixed with
the hard next-token label. The EAGLE head is unrolled ``depth`` steps (step j reads its own feature
from step j - 1, as when drafting) with a regression of each predicted feature on the target's.

Resumable: the data is cached in ``out``/distill_data.pt and the training state (weights,
optimizer, step, RNG) in ``out``/train_state.pt every ``save_every`` steps; both are removed when
the draft is written (a head: engine/spec_decode/heads/checkpoint.py's format; a model: a Hugging Face checkpoint with
the target's tokenizer).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from engine.core.checkpoint import DTYPES
from engine.core.errors import InvalidConfigError
from engine.core.files import write_file_atomic, write_text_atomic
from engine.spec_decode.heads.checkpoint import save_head
from engine.spec_decode.heads.config import HeadConfig, target_fingerprint
from engine.spec_decode.heads.eagle3 import Eagle3Head, default_feature_layers
from engine.spec_decode.heads.modules import init_head
from engine.spec_decode.registry import DRAFTERS
from engine.train.data import DistillData, cut_prompts, generate, label
from engine.train.draft_model import draft_model_config, save_draft_model
from engine.train.heldout import heldout_acceptance, heldout_data
from engine.train.losses import frequent_tokens, head_loss, model_loss

log = logging.getLogger(__name__)

# eagle3's default training-time test depth: EAGLE-3 unrolls 7; 5 here, the K of the rounds it is measured at
# (a step of the unroll costs a layer pass over every position, so 5 trains 1.4x more steps than 7 in a budget)
EAGLE3_DEPTH = 5
KINDS = DRAFTERS.trainable()  # the drafters specmix-train-draft trains (engine/spec_decode/registry.py)


@dataclass(frozen=True)
class TrainOptions:
    kind: str = "eagle"
    steps: int | None = None  # default: default_steps(kind)
    layers: int | None = None  # model: layers (2); medusa: blocks/head (1); eagle: MLP blocks or decoder layers (1)
    hidden: int | None = None  # model: hidden size (target's / 3, a multiple of 64); eagle: MLP width (target's)
    heads: int = 4  # medusa: heads (draft positions); eagle: the unrolled depth trained
    attention: bool = (
        False  # eagle: decoder layers with attention over the sequence (engine/spec_decode/heads/eagle_attn.py)
    )
    draft_vocab: int | None = None  # heads: the most frequent tokens of the text (None: default_draft_vocab)
    samples: int = 256  # generated sequences
    prompt_len: int = 32
    gen_len: int = 224
    temperature: float = 0.8
    greedy_share: float = 0.5  # of the sequences continued greedily (the rest sampled at temperature)
    topk: int = 32
    positions: int = 512  # heads: (sequence, position) windows per step; model: tokens per step / T
    lr: float | None = None  # default: 3e-3 (heads), 3e-3 (model)
    hard_weight: float = 0.1
    reg_weight: float = 0.5  # eagle: weight of the feature regression (smooth L1)
    warmup: int = 20
    save_every: int = 100
    seed: int = 0
    # the trained weights rounded to this dtype's values when written (the tensors stay fp32), as a draft
    # published in bf16 and loaded in fp32 is; "float32": unrounded
    weight_values: str = "float32"
    # "generated": the target continues prompts cut from the text (its own distribution, what drafts meet);
    # "text": windows of prompt_len + gen_len tokens of the text itself, labelled by one target forward (no
    # generation: far cheaper, but the text's distribution)
    data: str = "generated"
    feature_layers: tuple[int, ...] = ()  # eagle3: the target layers it fuses (empty: 2, L // 2, L - 3)

    def __post_init__(self) -> None:
        if self.data not in ("generated", "text"):
            raise InvalidConfigError(f"data={self.data!r} is invalid: allowed 'generated', 'text'")
        if self.feature_layers and (self.kind != "eagle3" or len(self.feature_layers) != 3):
            raise InvalidConfigError(f"feature_layers={self.feature_layers!r}: allowed 3 layers with kind='eagle3'")
        if self.kind not in KINDS:
            raise InvalidConfigError(f"kind={self.kind!r} is invalid: allowed {', '.join(KINDS)}")
        value_dtype(self.weight_values)
        if self.attention and self.kind != "eagle":
            raise InvalidConfigError(f"attention=True is invalid with kind={self.kind!r}: allowed with kind='eagle'")
        for name in ("steps", "layers", "hidden", "draft_vocab"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise InvalidConfigError(f"{name}={v!r} is invalid: allowed an int >= 1 or None (the default)")
        for name in ("heads", "samples", "prompt_len", "gen_len", "topk", "positions", "save_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidConfigError(f"{name}={v!r} is invalid: allowed an int >= 1")
        if not self.temperature >= 0:
            raise InvalidConfigError(f"temperature={self.temperature!r} is invalid: allowed a float >= 0")
        if not 0.0 <= self.greedy_share <= 1.0:
            raise InvalidConfigError(f"greedy_share={self.greedy_share!r} is invalid: allowed 0.0 .. 1.0")


@dataclass(frozen=True)
class RunOptions:
    """How ``train_draft`` runs and what it evaluates, beside what it trains (``TrainOptions``)."""

    device: str = "cpu"
    """Where the target runs (generates and labels the text) and the draft trains: "cpu" or "cuda"."""
    progress: bool = True
    """Progress bars for the generation, the labelling and the training."""
    heldout: int = 8
    """Prompts apart from the training prompts, continued greedily and never trained on: the report's
    ``heldout`` gives the trained draft's greedy rounds simulated on them (engine/train/heldout.py).
    0 (or a text too short to leave such prompts, logged): no held-out evaluation, ``heldout`` None."""
    eval_k: int = 5
    """K of the held-out evaluation's rounds (medusa: at most its heads)."""

    def __post_init__(self) -> None:
        if not isinstance(self.heldout, int) or self.heldout < 0:
            raise InvalidConfigError(f"heldout={self.heldout!r} is invalid: allowed an int >= 0")
        if not isinstance(self.eval_k, int) or self.eval_k < 1:
            raise InvalidConfigError(f"eval_k={self.eval_k!r} is invalid: allowed an int >= 1")


VALUE_DTYPES = ("float32", "bfloat16", "float16")  # weight_values: names of engine.core.checkpoint.DTYPES


def value_dtype(values: str) -> torch.dtype:
    if values not in VALUE_DTYPES:
        raise InvalidConfigError(f"weight_values={values!r} is invalid: allowed {', '.join(VALUE_DTYPES)}")
    return DTYPES[values]


@torch.no_grad()
def round_weights(module: nn.Module, values: str) -> None:
    """Round every parameter to the nearest value of dtype ``values`` (the tensors keep their dtype)."""
    dtype = value_dtype(values)
    for p in module.parameters():
        p.copy_(p.to(dtype).to(p.dtype))


def default_steps(kind: str) -> int:
    # eagle3: each step runs its layer and LM head at every unrolled depth over whole sequences; with its reduced
    # draft vocabulary (default_draft_vocab) 1,000 steps keep SmolLM2's head within half an hour on a 2-core CPU
    return {"model": 1500, "medusa": 600, "eagle": 600, "eagle3": 1000}[kind]


EAGLE3_MAX_VOCAB = 32768  # EAGLE-3's draft vocabulary for Llama 3's 128k


def default_draft_vocab(kind: str, data: DistillData, cap: int = EAGLE3_MAX_VOCAB) -> int | None:
    """eagle3: the distinct tokens of the training text (the head learns nothing of the others), at most ``cap``;
    its LM head is most of a draft step's bytes. The other heads: None (all)."""
    if kind != "eagle3":
        return None
    mask = torch.arange(data.tokens.shape[1], device=data.tokens.device)[None] < data.lengths[:, None]
    return min(int(data.tokens[mask].unique().numel()), cap)


def _lr(step: int, total: int, warmup: int, lr: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def train_loop(
    module: nn.Module,
    loss_fn: Callable[[torch.Generator], Tensor],
    opts: TrainOptions,
    steps: int,
    state_path: Path,
    progress: bool,
) -> float:
    """AdamW with warmup + cosine, clip 1.0; resumes from ``state_path`` and saves it every save_every steps."""
    params = [p for p in module.parameters() if p.requires_grad]
    lr = opts.lr or 3e-3
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(opts.seed + 7)
    start, ema = 0, float("nan")
    if state_path.is_file():
        st = torch.load(state_path, weights_only=False)
        _check_resumable(module, st["module"], state_path)
        module.load_state_dict(st["module"])
        opt.load_state_dict(st["opt"])
        g.set_state(st["rng"])
        start, ema = st["step"], st["ema"]
        log.info("resuming the training at step %d of %d", start, steps)
    module.train()
    bar = tqdm(range(start, steps), desc="training", disable=not progress, leave=False, initial=start, total=steps)
    for step in bar:
        loss = loss_fn(g)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for grp in opt.param_groups:
            grp["lr"] = _lr(step, steps, opts.warmup, lr)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
        if (step + 1) % opts.save_every == 0 and step + 1 < steps:
            state = {"module": module.state_dict(), "opt": opt.state_dict(), "rng": g.get_state()}
            write_file_atomic(state_path, functools.partial(torch.save, {**state, "step": step + 1, "ema": ema}))
    module.eval()
    return ema


def _check_resumable(module: nn.Module, saved: dict[str, Tensor], path: Path) -> None:
    """Refuses a saved training state whose tensors differ from ``module``'s (a run with other options: a draft
    vocabulary, width or depth), naming the first difference."""
    own = module.state_dict()
    for name in sorted(set(own) | set(saved)):
        a, b = own.get(name), saved.get(name)
        if a is None or b is None or a.shape != b.shape:
            theirs, ours = (("absent" if t is None else tuple(t.shape)) for t in (b, a))
            raise InvalidConfigError(
                f"{path} holds the state of a run with other options ({name}: saved {theirs}, this run {ours}): "
                "rerun with that run's options, or delete it to start afresh"
            )


@dataclass(frozen=True)
class _Fit:
    """What training either kind of draft reads."""

    eng: Any
    """The target's engine (its model and tokenizer)."""
    data: DistillData
    """The labelled generated text, on the training device."""
    held: DistillData | None
    """The held-out greedy continuations, on the training device; None: no held-out evaluation."""
    steps: int
    """Training steps."""
    state: Path
    """The resumable training state (train_loop)."""
    t0: float
    """When the training began (time.perf_counter): the report's train_s counts from it."""
    run: RunOptions
    """The call's run options (progress, eval_k)."""


def _distill_data(
    eng: Any, opts: TrainOptions, text: str, data_path: Path, run: RunOptions
) -> tuple[DistillData, DistillData | None]:
    """(the labelled data: cached in ``data_path``, else generated by the target and labelled, then cached;
    the held-out greedy continuations, or None)."""
    ids: list[int] | None = None  # the text's tokens, encoded once
    if data_path.is_file():
        data = DistillData.load(data_path)
        log.info("using the cached distillation data in %s", data_path)
    else:
        ids = eng.tokenizer.encode(text)
        if opts.data == "text":  # the text itself, no generation
            seqs, gen_s = cut_prompts(ids, opts.samples, opts.prompt_len + opts.gen_len, opts.seed), 0.0
        else:
            prompts = cut_prompts(ids, opts.samples, opts.prompt_len, opts.seed)
            seqs, gen_s = generate(
                eng, prompts, opts.gen_len, opts.temperature, opts.seed, run.progress, greedy_share=opts.greedy_share
            )
        data = replace(
            label(eng.target, seqs, opts.topk, opts.kind != "model", opts.prompt_len, run.progress), gen_seconds=gen_s
        )
        data.save(data_path)
    held = None
    if run.heldout:
        held = heldout_data(eng, eng.tokenizer.encode(text) if ids is None else ids, run.heldout, opts, run.progress)
    return data, held


def _train_model(opts: TrainOptions, fit: _Fit, target_dir: Path, out: Path) -> tuple[float, float, Any]:
    """Train a draft model and write it into ``out``: (final loss, training seconds, held-out figures or None)."""
    from engine.core.model import Transformer

    target = fit.eng.target
    cfg = target.config
    hidden = opts.hidden or max(64, cfg.hidden_size // 3 // 64 * 64)
    torch.manual_seed(opts.seed)
    draft = Transformer(draft_model_config(cfg, opts.layers or 2, hidden))
    for p in draft.parameters():
        (nn.init.ones_ if p.dim() == 1 else lambda t: nn.init.normal_(t, std=0.02))(p)
    draft.to(target.norm.weight.device)
    loss = train_loop(
        draft, lambda g: model_loss(draft, fit.data, opts, g), opts, fit.steps, fit.state, fit.run.progress
    )
    round_weights(draft, opts.weight_values)
    train_s = time.perf_counter() - fit.t0
    held = None
    if fit.held is not None:
        held = heldout_acceptance("model", draft, target, fit.held, fit.run.eval_k, None, None)
    save_draft_model(draft, target_dir, out)
    return loss, train_s, held


def _head_config(opts: TrainOptions, eng: Any, vocab_ids: Tensor | None) -> HeadConfig:
    """The head's config: its shape from ``opts`` and the target's, and the target's fingerprint."""
    cfg = eng.target.config
    e3 = opts.kind == "eagle3"  # one decoder layer of the target's attention shape and MLP width
    attn = opts.attention or e3
    return HeadConfig(
        kind=opts.kind,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        layers=opts.layers or 1,
        intermediate_size=opts.hidden or (cfg.intermediate_size if e3 else 0),
        num_heads=opts.heads,
        draft_vocab=None if vocab_ids is None else len(vocab_ids),
        attention=opts.attention,
        attention_heads=cfg.num_attention_heads if attn else 0,
        kv_heads=cfg.num_key_value_heads if attn else 0,
        head_dim=cfg.head_dim if attn else 0,
        rms_norm_eps=cfg.rms_norm_eps,
        feature_layers=(opts.feature_layers or default_feature_layers(cfg.num_hidden_layers)) if e3 else (),
        target=target_fingerprint(eng.target, eng.tokenizer.vocab()),
    )


def _train_head(opts: TrainOptions, fit: _Fit, vocab_ids: Tensor | None, out: Path) -> tuple[float, float, Any]:
    """Train Medusa heads or an EAGLE-style head (on the draft vocabulary ``vocab_ids`` when given) and write
    it into ``out``: (final loss, training seconds, held-out figures or None)."""
    target = fit.eng.target
    dev = target.norm.weight.device
    hcfg = _head_config(opts, fit.eng, vocab_ids)
    head = init_head(hcfg, target, opts.seed).to(dev)
    lm_w = target.lm_head.weight.detach().float()
    pos_of = None
    if vocab_ids is not None:
        vocab_ids = vocab_ids.to(dev)  # save_head writes it from the CPU
        lm_w = lm_w[vocab_ids]
        pos_of = torch.full((target.config.vocab_size,), -1, dtype=torch.long, device=dev)
        pos_of[vocab_ids] = torch.arange(len(vocab_ids), device=dev)
    if isinstance(head, Eagle3Head):  # its own LM head starts as the target's rows of its vocabulary (EAGLE-3's)
        head.lm_head.weight.data.copy_(lm_w)
    loss = train_loop(
        head,
        lambda g: head_loss(opts.kind, head, target, lm_w, pos_of, fit.data, opts, g),
        opts,
        fit.steps,
        fit.state,
        fit.run.progress,
    )
    round_weights(head, opts.weight_values)
    train_s = time.perf_counter() - fit.t0
    held = None
    if fit.held is not None:
        k = min(fit.run.eval_k, hcfg.max_drafts or fit.run.eval_k)
        held = heldout_acceptance(opts.kind, head, target, fit.held, k, lm_w, vocab_ids)
    save_head(head, hcfg, vocab_ids, out)
    return loss, train_s, held


def train_draft(
    target_dir: str | Path,
    out: str | Path,
    opts: TrainOptions,
    text: str,
    run: RunOptions | None = None,
    *,
    engine: Any = None,
) -> dict[str, Any]:
    """Generate, label, train and write the draft into ``out``; returns a report (also out/train_report.json).

    ``run`` (None: ``RunOptions()``): the device, progress bars and the held-out evaluation, whose figures
    are the report's ``heldout`` (None without one). ``engine``: the target's Engine, when the caller has it."""
    run = RunOptions() if run is None else run
    from engine.api.engine import Engine

    target_dir, out = Path(target_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    eng = engine or Engine.from_pretrained(target_dir, device=run.device)
    report: dict[str, Any] = {"options": asdict(opts), "heldout": None}
    data_path, state = out / "distill_data.pt", out / "train_state.pt"
    if opts.kind == "eagle3":  # its features: the hidden states entering these layers (the labels' forward)
        n_layers = eng.target.config.num_hidden_layers
        eng.target.use_feature_layers(opts.feature_layers or default_feature_layers(n_layers))
    data, held = _distill_data(eng, opts, text, data_path, run)
    report.update(
        generated_tokens=data.generated_tokens,
        gen_s=round(data.gen_seconds, 1),
        gen_tokens_per_s=round(data.generated_tokens / data.gen_seconds, 1) if data.gen_seconds else None,
        label_s=round(data.label_seconds, 1),
    )
    steps = opts.steps or default_steps(opts.kind)
    t0 = time.perf_counter()
    dev = eng.target.norm.weight.device  # the draft trains where the target runs (its features, LM head, embedding)
    vocab_ids = None
    n_draft = opts.draft_vocab if opts.draft_vocab is not None else default_draft_vocab(opts.kind, data)
    if opts.kind != "model" and n_draft is not None:
        vocab_ids = frequent_tokens(data, n_draft, eng.target.config.vocab_size)
    fit = _Fit(eng, data.to(dev), None if held is None else held.to(dev), steps, state, t0, run)
    if opts.kind == "model":
        loss, train_s, report["heldout"] = _train_model(opts, fit, target_dir, out)
    else:
        loss, train_s, report["heldout"] = _train_head(opts, fit, vocab_ids, out)
    draft_vocab = None if vocab_ids is None else len(vocab_ids)
    report.update(kind=opts.kind, steps=steps, draft_vocab=draft_vocab, train_s=round(train_s, 1))
    report.update(final_loss=round(loss, 4))
    write_text_atomic(out / "train_report.json", json.dumps(report, indent=2) + "\n")
    for p in (data_path, state):
        p.unlink(missing_ok=True)
    eng.target.use_feature_layers(())  # (the target's features are its final-norm outputs again)
    return report
