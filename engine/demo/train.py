"""Training the demo pair (engine/demo/pair.py names, caches and builds it; this trains it).

``build_pair(recipe, out)``: a byte-level BPE tokenizer on the training split, the target trained on
next-token cross-entropy and saved as a Hugging Face checkpoint (engine/demo/checkpoints.py), the
draft trained for it by the train-draft tool (engine/train/distill.py: on text the target generates,
with its soft labels), both evaluated on the held-out split (engine/demo/evaluate.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from engine.core.checkpoint import load_model
from engine.core.config import ModelConfig
from engine.core.model import Transformer
from engine.demo.checkpoints import save_checkpoint
from engine.demo.evaluate import evaluate_pair
from engine.demo.grow import grow_width
from engine.demo.recipe import (
    EOS_TOKEN,
    RECIPE_VERSION,
    DemoRecipe,
    ModelShape,
    demo_texts,
    trained_shape,
)
from engine.train.distill import RunOptions, round_weights, train_draft, value_dtype

log = logging.getLogger(__name__)


@contextmanager
def _torch_settings(recipe: DemoRecipe) -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(recipe.threads, os.cpu_count() or 1)))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            yield
    finally:
        torch.set_num_threads(threads)


def _use_bf16(recipe: DemoRecipe) -> bool:
    return recipe.bf16 and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def build_pair(recipe: DemoRecipe, out: Path, progress: bool = True, size: str = "custom") -> dict[str, Any]:
    """Train tokenizer, target and draft into ``out`` (target/, draft/, *.txt, report.json)."""
    t_all = time.perf_counter()
    texts = demo_texts()
    report: dict[str, Any] = {"size": size, "recipe_version": RECIPE_VERSION, "recipe": asdict(recipe)}
    value_dtype(recipe.weight_values)  # refused before any training, as is a bad grow
    shape = trained_shape(recipe)
    with _torch_settings(recipe):
        bf16 = _use_bf16(recipe)
        t0 = time.perf_counter()
        tok = train_tokenizer(texts["train"], recipe.vocab_size)
        report["tokenizer_s"] = round(time.perf_counter() - t0, 2)
        train_ids = torch.tensor(tok.encode(texts["train"]).ids, dtype=torch.long)
        held_ids = torch.tensor(tok.encode(texts["heldout"]).ids, dtype=torch.long)
        eos = tok.token_to_id(EOS_TOKEN)
        target = _init_model(_model_config(recipe, shape, eos))
        t0 = time.perf_counter()
        tloss = _train_target(target, train_ids, recipe, bf16, progress)
        round_weights(target, recipe.weight_values)
        report["target"] = {
            "trained_params": _params(target),
            "train_s": round(time.perf_counter() - t0, 1),
            "steps": recipe.target_steps,
            "final_train_loss": round(tloss, 4),
        }
        # the draft learns from the trained target: with grow > 1 the narrow one, the same function as
        # the grown target at a fraction of the cost to generate and label with
        teacher = out / ("target" if recipe.grow == 1 else "trained-target")
        save_checkpoint(target, tok, teacher)
        t0 = time.perf_counter()
        run = RunOptions(progress=progress, heldout=8, eval_k=5)
        drep = train_draft(teacher, out / "draft", recipe.draft, texts["train"], run)
        draft_s = round(time.perf_counter() - t0, 1)
        if recipe.grow > 1:
            target = grow_width(target, recipe.grow)
            save_checkpoint(target, tok, out / "target")
            shutil.rmtree(teacher)
        report["target"]["params"] = _params(target)
        draft = load_model(out / "draft")
        report["draft"] = {
            "params": _params(draft),
            "train_s": draft_s,
            "steps": drep["steps"],
            "final_distill_loss": drep["final_loss"],
            "generated_tokens": drep["generated_tokens"],
            "gen_s": drep["gen_s"],
            "label_s": drep["label_s"],
            "greedy_rounds_k5": drep["heldout"],  # 8 held-out greedy continuations (train/heldout.py)
        }
        ev = evaluate_pair(target, draft, held_ids, recipe.eval_ctx)
        report["target"]["heldout_ppl"] = ev["target_ppl"]
        report["draft"]["heldout_ppl"] = ev["draft_ppl"]
        report["agreement"] = ev["agreement"]
        report["eval_positions"] = ev["positions"]
    report.update(
        vocab_size=tok.get_vocab_size(),
        train_tokens=len(train_ids),
        heldout_tokens=len(held_ids),
        bf16_training=bf16,
        threads=recipe.threads,
    )
    (out / "heldout.txt").write_text(texts["heldout"], encoding="utf-8")
    (out / "calib.txt").write_text(texts["calib"], encoding="utf-8")
    report["total_s"] = round(time.perf_counter() - t_all, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    log.info(
        "demo pair %s: target %.1fM params ppl %.2f, draft %.2fM params ppl %.2f, agreement %.3f, %.0f s",
        size,
        report["target"]["params"] / 1e6,
        report["target"]["heldout_ppl"],
        report["draft"]["params"] / 1e6,
        report["draft"]["heldout_ppl"],
        report["agreement"],
        report["total_s"],
    )
    return report


def train_tokenizer(text: str, vocab_size: int) -> Any:
    """Byte-level BPE (tokenizers library) with the eos token as id 0."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    return tok


def _model_config(recipe: DemoRecipe, s: ModelShape, eos: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=recipe.vocab_size,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.hidden // s.heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_ids=[eos],
    )


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts a tied weight once


def _init_model(cfg: ModelConfig) -> Transformer:
    """GPT-2 style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)."""
    model = Transformer(cfg)
    resid = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            torch.nn.init.ones_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(p, std=resid)
        else:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _schedule(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def _autocast(bf16: bool) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()


def _train(
    model: Transformer,
    recipe: DemoRecipe,
    steps: int,
    lr: float,
    desc: str,
    progress: bool,
    loss_fn: Callable[[int], torch.Tensor],
) -> float:
    """AdamW (decoupled weight decay on matrices), warmup + cosine to lr / 10, clip 1.0; EMA of the loss."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    model.train()
    ema = float("nan")
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False)
    for step in bar:
        loss = loss_fn(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = lr * _schedule(step, steps, recipe.warmup)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    model.eval()
    return ema


def _train_target(model: Transformer, ids: torch.Tensor, recipe: DemoRecipe, bf16: bool, progress: bool) -> float:
    """Next-token cross-entropy on random windows of the training split."""
    gen = torch.Generator().manual_seed(recipe.seed + 1)

    def loss_fn(step: int) -> torch.Tensor:
        long = recipe.long_every > 0 and step % recipe.long_every == recipe.long_every - 1
        T, B = (2 * recipe.seq_len, max(1, recipe.batch // 2)) if long else (recipe.seq_len, recipe.batch)
        starts = torch.randint(0, len(ids) - T - 1, (B,), generator=gen)
        x = torch.stack([ids[s : s + T + 1] for s in starts.tolist()])
        with _autocast(bf16):
            logits = model(x[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())

    p = recipe.target_dropout
    hooks = (
        [
            m.register_forward_hook(lambda mod, inp, out: F.dropout(out, p, mod.training))
            for layer in model.layers
            for m in (layer.self_attn, layer.mlp)
        ]
        if p > 0
        else []
    )
    try:
        return _train(model, recipe, recipe.target_steps, recipe.target_lr, "target", progress, loss_fn)
    finally:
        for h in hooks:
            h.remove()
