"""The demo pair's recipe: its sizes, its corpus and the cache directory that names a build.

The recipe (a ``DemoRecipe`` per size), the recipe version and a digest of the corpus
name the cache directory, so a change of any of them rebuilds (engine/demo/pair.py).

The demo target trains at a quarter of its width and is grown to its full width by unit duplication
(engine/demo/grow.py): a 58M-parameter model that costs what 58M parameters cost to run and computes
what its 3.9M trained parameters compute, built in minutes on 2 CPU cores.

Corpus: ``pydoc_data.topics`` (values joined in sorted-key order); the last 10%
(cut at a line boundary) is held out and never trained on; the calibration
slice is the last 5% of the training split (never the held-out text).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.core.errors import InvalidConfigError
from engine.core.files import default_cache_dir
from engine.train.distill import TrainOptions

log = logging.getLogger(__name__)

RECIPE_VERSION = 5  # bump when the code of the recipe (not only its numbers) changes
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
    # the draft: trained by the train-draft tool (engine/train/distill.py) on text the trained target
    # generates from prompts cut out of the training split, with the target's soft labels
    draft: TrainOptions
    target_steps: int
    # the target trains at 1/grow of its width (hidden size, heads, FFN units; the head size kept) and is
    # then grown to ``target`` by unit duplication, which keeps its function (engine/demo/grow.py): it
    # runs at the cost of ``target`` for 1/grow^2 of the training compute; 1: trained at ``target``
    grow: int = 1
    batch: int = 4  # windows per step (a long step uses half as many, twice as long)
    seq_len: int = 512
    long_every: int = 4  # every n-th target step uses 2 * seq_len windows (0: never)
    max_position_embeddings: int = 1024
    target_lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.1
    target_dropout: float = 0.0  # on the attention and MLP outputs while the target trains
    eval_ctx: int = 512  # held-out windows (llama.cpp style: score the second half)
    seed: int = 0
    threads: int = 2
    bf16: bool = True  # bf16 autocast for training the target when the CPU supports it
    # the target's trained weights rounded to this dtype's values (still saved as fp32), as a checkpoint
    # published in bf16 and loaded in fp32 is (Llama-3, Qwen2.5); the draft learns from the rounded
    # target, and its own rounding is draft.weight_values; "float32": unrounded
    weight_values: str = "float32"


RECIPES: dict[str, DemoRecipe] = {
    # The demo size: weights with bf16 values, like the real pairs' bf16 checkpoints (an fp32 engine
    # streams them at half width without changing a bit: engine/kernels/cpu_decode.py); a target deep
    # enough (8 layers, 58M) that a verify pass costs little more than a step beside a 2-layer draft,
    # trained at a quarter of its width (3.9M) and grown, so that it trains in minutes on 2 cores.
    "demo": DemoRecipe(
        vocab_size=2048,
        target=ModelShape(768, 8, 2048, 12, 12),
        draft=TrainOptions(kind="model", layers=2, hidden=256, steps=800, positions=1024, weight_values="bfloat16"),
        target_steps=300,
        grow=4,
        target_lr=3e-3,
        target_dropout=0.1,
        weight_values="bfloat16",
    ),
    "tiny": DemoRecipe(
        vocab_size=512,
        target=ModelShape(192, 2, 512, 4, 4),
        draft=TrainOptions(
            kind="model", layers=1, hidden=64, steps=200, samples=64, prompt_len=16, gen_len=112, lr=1e-2
        ),
        target_steps=200,
        batch=4,
        seq_len=128,
        long_every=0,
        max_position_embeddings=256,
        target_lr=3e-3,
        warmup=10,
        eval_ctx=256,
    ),
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
    return {"train": train, "calib": train[_cut(train, 0.95) :], "heldout": heldout}


def trained_shape(recipe: DemoRecipe) -> ModelShape:
    """The shape the target trains at: ``recipe.target`` divided by ``recipe.grow`` (head size kept)."""
    t, g = recipe.target, recipe.grow
    if g < 1 or g & (g - 1) or any(v % g for v in (t.hidden, t.intermediate, t.heads, t.kv_heads)):
        raise InvalidConfigError(
            f"grow={g} is invalid: allowed a power of two dividing the target's hidden size, FFN size and heads"
        )
    return ModelShape(t.hidden // g, t.layers, t.intermediate // g, t.heads // g, t.kv_heads // g)


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
