"""The embedded demo pair: a target and a distilled draft trained on CPython's docs.

``demo_pair(size)`` returns ``(target_dir, draft_dir)``, building them on the CPU
when the cache lacks them. The recipe (a ``DemoRecipe`` per size), the recipe
version and a digest of the corpus name the cache directory, so a change of any
of them rebuilds. A build happens in a temporary directory beside the target and
is renamed into place at the end under a lock: a killed build leaves no pair.

Corpus: ``pydoc_data.topics`` (values joined in sorted-key order); the last 10%
(cut at a line boundary) is held out and never trained on; the calibration
slice is the last 5% of the training split (never the held-out text).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .config import ModelConfig
from .errors import InvalidConfigError
from .model import KVCache, Transformer

log = logging.getLogger(__name__)

RECIPE_VERSION = 1  # bump when the code of the recipe (not only its numbers) changes
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int


@dataclass(frozen=True)
class DemoRecipe:
    vocab_size: int
    target: ModelShape
    draft: ModelShape
    target_steps: int
    draft_steps: int
    batch: int = 4  # windows per step (a long step uses half as many, twice as long)
    seq_len: int = 512
    long_every: int = 4  # every n-th target step uses 2 * seq_len windows (0: never)
    max_position_embeddings: int = 1024
    target_lr: float = 1e-3
    draft_lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    target_dropout: float = 0.0  # on the attention and MLP outputs while the target trains
    distill_topk: int = 64
    distill_offsets: int = 2  # target soft labels on chunks of 2 * seq_len at this many offsets
    hard_weight: float = 0.1  # loss = (1 - w) * soft CE + w * hard CE
    distill_tail: bool = True
    distill_sampled: int = 0  # extra chunks of text sampled from the target (prompted by training text)
    eval_ctx: int = 512  # held-out windows (llama.cpp style: score the second half)
    seed: int = 0
    threads: int = 2
    bf16: bool = True  # bf16 autocast for training when the CPU supports it


RECIPES: dict[str, DemoRecipe] = {
    "demo": DemoRecipe(
        vocab_size=2048, target=ModelShape(768, 4, 2048, 12, 12), draft=ModelShape(256, 2, 768, 4, 4),
        target_steps=300, draft_steps=600),
    "tiny": DemoRecipe(
        vocab_size=512, target=ModelShape(192, 2, 512, 4, 4), draft=ModelShape(64, 1, 192, 2, 2),
        target_steps=200, draft_steps=200, batch=4, seq_len=128, long_every=0, max_position_embeddings=256,
        target_lr=3e-3, draft_lr=1e-2, warmup=10, eval_ctx=256, distill_topk=32),
}


def corpus_text() -> str:
    """The English text that ships with CPython: ``pydoc_data.topics`` joined in key order."""
    from pydoc_data.topics import topics
    return "".join(topics[k] for k in sorted(topics))


def _cut(text: str, frac: float) -> int:
    """Index of the line start at or before ``frac`` of ``text``."""
    return text.rfind("\n", 0, int(len(text) * frac)) + 1


def demo_texts() -> dict[str, str]:
    """``train`` (first 90%), ``calib`` (last 5% of train, part of it) and ``heldout`` (last 10%)."""
    text = corpus_text()
    i = _cut(text, 0.9)
    train, heldout = text[:i], text[i:]
    return {"train": train, "calib": train[_cut(train, 0.95):], "heldout": heldout}


def default_cache_dir() -> Path:
    """$SPECMIX_CACHE, else $XDG_CACHE_HOME/specmix, else ~/.cache/specmix."""
    env = os.environ.get("SPECMIX_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specmix"


def get_recipe(size: str) -> DemoRecipe:
    if size not in RECIPES:
        raise InvalidConfigError(f"size={size!r} is invalid: allowed {', '.join(sorted(RECIPES))}")
    return RECIPES[size]


def pair_dir(size: str, cache_dir: str | Path | None = None) -> Path:
    """The cache directory of a size: ``<cache>/demo-<size>-v<version>-<digest of recipe + corpus>``."""
    recipe = get_recipe(size)
    h = hashlib.sha256(json.dumps([RECIPE_VERSION, asdict(recipe)], sort_keys=True).encode())
    h.update(corpus_text().encode())
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / f"demo-{size}-v{RECIPE_VERSION}-{h.hexdigest()[:10]}"


def demo_pair(size: str = "demo", cache_dir: str | Path | None = None, progress: bool = True,
              force: bool = False) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of the demo pair of ``size``, built first when the cache lacks it."""
    final = pair_dir(size, cache_dir)
    if force or not (final / "report.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        with _lock(final.parent / f".{final.name}.lock"):
            if force and final.exists():
                shutil.rmtree(final)
            if not (final / "report.json").is_file():
                _build_atomic(size, final, progress)
    return final / "target", final / "draft"


def demo_report(size: str = "demo", cache_dir: str | Path | None = None) -> dict[str, Any]:
    """The build report of a pair (builds it when missing)."""
    target, _ = demo_pair(size, cache_dir, progress=False)
    return json.loads((target.parent / "report.json").read_text(encoding="utf-8"))


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_atomic(size: str, final: Path, progress: bool) -> None:
    # we hold the lock: any temp dir left beside the target is from a killed build
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        log.warning("removing %s (left by an interrupted build)", stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        build_pair(get_recipe(size), tmp, progress=progress, size=size)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- building


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
    with _torch_settings(recipe):
        bf16 = _use_bf16(recipe)
        t0 = time.perf_counter()
        tok = train_tokenizer(texts["train"], recipe.vocab_size)
        report["tokenizer_s"] = round(time.perf_counter() - t0, 2)
        train_ids = torch.tensor(tok.encode(texts["train"]).ids, dtype=torch.long)
        held_ids = torch.tensor(tok.encode(texts["heldout"]).ids, dtype=torch.long)
        eos = tok.token_to_id(EOS_TOKEN)
        tcfg, dcfg = (_model_config(recipe, s, eos) for s in (recipe.target, recipe.draft))
        target = _init_model(tcfg)
        t0 = time.perf_counter()
        tloss = _train_target(target, train_ids, recipe, bf16, progress)
        report["target"] = {"params": _params(target), "train_s": round(time.perf_counter() - t0, 1),
                            "steps": recipe.target_steps, "final_train_loss": round(tloss, 4)}
        draft = _init_model(dcfg)
        t0 = time.perf_counter()
        dloss = _distill_draft(draft, target, train_ids, recipe, bf16, progress)
        report["draft"] = {"params": _params(draft), "train_s": round(time.perf_counter() - t0, 1),
                           "steps": recipe.draft_steps, "final_distill_loss": round(dloss, 4)}
        ev = evaluate_pair(target, draft, held_ids, recipe.eval_ctx)
        report["target"]["heldout_ppl"] = ev["target_ppl"]
        report["draft"]["heldout_ppl"] = ev["draft_ppl"]
        report["agreement"] = ev["agreement"]
        report["eval_positions"] = ev["positions"]
    report.update(vocab_size=tok.get_vocab_size(), train_tokens=len(train_ids), heldout_tokens=len(held_ids),
                  bf16_training=bf16, threads=recipe.threads)
    for name, model in (("target", target), ("draft", draft)):
        save_checkpoint(model, tok, out / name)
    (out / "heldout.txt").write_text(texts["heldout"], encoding="utf-8")
    (out / "calib.txt").write_text(texts["calib"], encoding="utf-8")
    report["total_s"] = round(time.perf_counter() - t_all, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    log.info("demo pair %s: target %.1fM params ppl %.2f, draft %.2fM params ppl %.2f, agreement %.3f, %.0f s",
             size, report["target"]["params"] / 1e6, report["target"]["heldout_ppl"],
             report["draft"]["params"] / 1e6, report["draft"]["heldout_ppl"], report["agreement"],
             report["total_s"])
    return report


def train_tokenizer(text: str, vocab_size: int) -> "Any":
    """Byte-level BPE (tokenizers library) with the eos token as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    return tok


def _model_config(recipe: DemoRecipe, s: ModelShape, eos: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=recipe.vocab_size, hidden_size=s.hidden,
        intermediate_size=s.intermediate, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, head_dim=s.hidden // s.heads,
        max_position_embeddings=recipe.max_position_embeddings, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=eos, eos_token_ids=[eos])


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


def _train(model: Transformer, recipe: DemoRecipe, steps: int, lr: float, desc: str, progress: bool,
           loss_fn: Callable[[int], torch.Tensor]) -> float:
    """AdamW (decoupled weight decay on matrices), warmup + cosine to lr / 10, clip 1.0; EMA of the loss."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
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
        x = torch.stack([ids[s: s + T + 1] for s in starts.tolist()])
        with _autocast(bf16):
            logits = model(x[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())

    p = recipe.target_dropout
    hooks = [m.register_forward_hook(lambda mod, inp, out: F.dropout(out, p, mod.training))
             for layer in model.layers for m in (layer.self_attn, layer.mlp)] if p > 0 else []
    try:
        return _train(model, recipe, recipe.target_steps, recipe.target_lr, "target", progress, loss_fn)
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def _soft_labels(target: Transformer, ids: torch.Tensor, recipe: DemoRecipe, bf16: bool, progress: bool,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunks [N, C] of the training ids and the target's top-k log-probs / indices [N, C, k] on them.

    Chunks of C = 2 * seq_len tokens at ``distill_offsets`` offsets; only as many (chosen at random)
    as the distillation steps will use are scored.
    """
    C = 2 * recipe.seq_len
    starts = [s for off in range(recipe.distill_offsets)
              for s in range(off * C // recipe.distill_offsets, len(ids) - C + 1, C)]
    bs = max(1, recipe.batch // 2)
    keep = torch.randperm(len(starts), generator=gen)[: recipe.draft_steps * bs].sort().values
    x = torch.stack([ids[starts[i]: starts[i] + C] for i in keep.tolist()])
    vals = torch.empty(len(x), C, recipe.distill_topk, dtype=torch.float16)
    idx = torch.empty(len(x), C, recipe.distill_topk, dtype=torch.int16 if recipe.vocab_size < 2**15 else torch.int32)
    step = 2 * recipe.batch
    for i in tqdm(range(0, len(x), step), desc="soft labels", disable=not progress, leave=False):
        with _autocast(bf16):
            logits = target(x[i: i + step])
        top = logits.float().log_softmax(-1).topk(recipe.distill_topk, dim=-1)
        vals[i: i + step], idx[i: i + step] = top.values.half(), top.indices.to(idx.dtype)
    return x, vals, idx


@torch.no_grad()
def _sampled_labels(target: Transformer, ids: torch.Tensor, recipe: DemoRecipe, bf16: bool, progress: bool,
                    gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``distill_sampled`` chunks of C = 2 * seq_len tokens: a 32-token training prompt continued by
    sampling the target (temperature 1), with the target's top-k log-probs [N, C, k] on the way."""
    n, C, P, k = recipe.distill_sampled, 2 * recipe.seq_len, 32, recipe.distill_topk
    x = torch.empty(n, C, dtype=torch.long)
    vals, idx = torch.empty(n, C, k, dtype=torch.float16), torch.empty(n, C, k, dtype=torch.int32)
    G = 32
    bar = tqdm(total=n * C, desc="sampled text", disable=not progress, leave=False, unit="tok")
    for b in range(0, n, G):
        g = min(G, n - b)
        starts = torch.randint(0, len(ids) - P, (g,), generator=gen).tolist()
        x[b: b + g, :P] = torch.stack([ids[s: s + P] for s in starts])
        cache = KVCache(target.config, g, C, torch.float32, "cpu")
        with _autocast(bf16):
            logits = target(x[b: b + g, :P], cache=cache, kv_len=P).float()
        for pos in range(P, C + 1):
            lp = logits.log_softmax(-1)
            top = lp.topk(k, dim=-1)
            vals[b: b + g, pos - logits.shape[1]: pos], idx[b: b + g, pos - logits.shape[1]: pos] = \
                top.values.half(), top.indices.int()
            if pos == C:
                break
            x[b: b + g, pos] = torch.multinomial(lp[:, -1].exp(), 1, generator=gen)[:, 0]
            with _autocast(bf16):
                logits = target(x[b: b + g, pos: pos + 1], input_pos=torch.full((g, 1), pos), cache=cache,
                                kv_len=pos + 1).float()
            bar.update(g)
    bar.close()
    return x, vals, idx


def _distill_draft(draft: Transformer, target: Transformer, ids: torch.Tensor, recipe: DemoRecipe,
                   bf16: bool, progress: bool) -> float:
    """KL(target || draft) over the target's top-k tokens plus one bucket for the rest of the
    vocabulary, mixed with the hard next-token labels: (1 - w) * KL + w * CE."""
    gen = torch.Generator().manual_seed(recipe.seed + 2)
    x, vals, idx = _soft_labels(target, ids, recipe, bf16, progress, gen)
    if recipe.distill_sampled:
        sx, sv, si = _sampled_labels(target, ids, recipe, bf16, progress, gen)
        x, vals, idx = torch.cat([x, sx]), torch.cat([vals, sv]), torch.cat([idx.int(), si])
    w, bs = recipe.hard_weight, max(1, recipe.batch // 2)

    def loss_fn(step: int) -> torch.Tensor:
        pick = torch.randint(0, len(x), (bs,), generator=gen)
        xb, t_lp = x[pick], vals[pick].float()  # target log-probs of its top-k [bs, C, k]
        with _autocast(bf16):
            logits = draft(xb)
        logq = logits.float().log_softmax(-1)
        d_lp = logq.gather(-1, idx[pick].long())
        t_rest = (1 - t_lp.exp().sum(-1)).clamp_min(0)
        d_rest = torch.log1p(-d_lp.exp().sum(-1).clamp_max(1 - 1e-6))
        kl = (t_lp.exp() * (t_lp - d_lp)).sum(-1) + torch.xlogy(t_rest, t_rest) - t_rest * d_rest
        if not recipe.distill_tail:
            kl = -(t_lp.softmax(-1) * d_lp).sum(-1)
        hard = F.nll_loss(logq[:, :-1].flatten(0, 1), xb[:, 1:].flatten())
        return (1 - w) * kl.mean() + w * hard

    return _train(draft, recipe, recipe.draft_steps, recipe.draft_lr, "draft", progress, loss_fn)


@torch.no_grad()
def evaluate_pair(target: Transformer, draft: Transformer, ids: torch.Tensor, ctx: int) -> dict[str, float]:
    """fp32 held-out perplexity of both and the draft's greedy top-1 agreement with the target.

    Non-overlapping windows of ``ctx`` tokens; the second half of each is scored (llama.cpp style).
    """
    n = len(ids) // ctx
    if n < 1:
        raise InvalidConfigError(f"eval_ctx={ctx} is invalid: allowed at most {len(ids)} (held-out tokens)")
    windows = ids[: n * ctx].view(n, ctx)
    nll = {"target": 0.0, "draft": 0.0}
    agree, count = 0, 0
    for w in windows.split(4):
        y = w[:, ctx // 2 + 1:]
        preds = {}
        for name, m in (("target", target), ("draft", draft)):
            logits = m(w)[:, ctx // 2: -1].float()
            nll[name] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            preds[name] = logits.argmax(-1)
        agree += (preds["target"] == preds["draft"]).sum().item()
        count += y.numel()
    return {"target_ppl": round(math.exp(nll["target"] / count), 4),
            "draft_ppl": round(math.exp(nll["draft"] / count), 4),
            "agreement": round(agree / count, 4), "positions": count}


@torch.no_grad()
def greedy_agreement(target: Transformer, draft: Transformer, ids: torch.Tensor, n_prompts: int = 16,
                     prompt_len: int = 64, new_tokens: int = 128) -> float:
    """Draft top-1 == target top-1 along the target's own greedy continuations of held-out prompts
    (the per-token acceptance of greedy speculative decoding)."""
    starts = torch.linspace(0, len(ids) - prompt_len - 1, n_prompts).long().tolist()
    seq = torch.stack([ids[s: s + prompt_len] for s in starts])
    cache = KVCache(target.config, n_prompts, prompt_len + new_tokens, torch.float32, "cpu")
    logits = target(seq, cache=cache, kv_len=prompt_len)[:, -1]
    for pos in range(prompt_len, prompt_len + new_tokens - 1):
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
        logits = target(seq[:, -1:], input_pos=torch.full((n_prompts, 1), pos), cache=cache, kv_len=pos + 1)[:, -1]
    seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    t_top = target(seq)[:, prompt_len - 1: -1].argmax(-1)
    d_top = draft(seq)[:, prompt_len - 1: -1].argmax(-1)
    return round((t_top == d_top).float().mean().item(), 4)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for transformers' LlamaForCausalLM (and engine.config.load_config)."""
    eos = cfg.eos_token_ids[0]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings, "initializer_range": 0.02, "pretraining_tp": 1,
        "use_cache": True, "bos_token_id": cfg.bos_token_id, "eos_token_id": eos, "pad_token_id": None,
        "torch_dtype": "float32", "dtype": "float32",
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
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN,
        "unk_token": None, "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings})
    _write_json(out / "special_tokens_map.json", {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN})


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
