"""``specmix-train-draft`` / tools/train_draft.py: train a draft model, Medusa heads or an EAGLE-style head.

    specmix-train-draft --target DIR --kind model|medusa|eagle|eagle3 --out DIR [--text FILE] [--steps N]
                        [--layers N] [--hidden N] [--heads N] [--attention] [--draft-vocab N] [--samples N]
                        [--data generated|text] [--feature-layers A,B,C] [--device cpu|cuda]
                        [--heldout N] [--eval-k K]

The target generates the training text itself (prompts cut from --text, default the demo corpus's
training split; never give it the evaluation text). Interrupted runs resume from ``--out``.
The report (printed and OUT/train_report.json) gives, under ``heldout``, the draft's greedy rounds at
K = --eval-k simulated on --heldout greedy continuations of prompts apart from the training prompts:
about the mean accepted length and acceptance rate tools/bench.py measures at that K.
Load the result with ``Engine.from_pretrained(target, OUT, drafter=KIND)``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engine.core.cli import OneLineParser, run_tool
from engine.core.errors import InvalidConfigError
from engine.train.distill import EAGLE3_DEPTH, KINDS, VALUE_DTYPES, RunOptions, TrainOptions, train_draft


def parse_args(argv: list[str] | None) -> object:
    p = OneLineParser(prog="specmix-train-draft", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="the target's checkpoint directory")
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--out", type=Path, required=True, help="output directory (resumes what is there)")
    p.add_argument("--text", type=Path, help="prompt text (default: the demo corpus's training split)")
    p.add_argument("--steps", type=int, help="training steps (default: model 1500, medusa and eagle 600, eagle3 1000)")
    p.add_argument(
        "--layers",
        type=int,
        help="model: layers (2); medusa: blocks per head (1); eagle: MLP blocks or --attention layers (1)",
    )
    p.add_argument("--hidden", type=int, help="model: hidden size (target's / 3); eagle: MLP width (target's)")
    p.add_argument(
        "--heads",
        type=int,
        help="medusa: heads (drafts per round, 4); eagle: unrolled depth (4); eagle3: training-time test steps (5)",
    )
    p.add_argument(
        "--attention", action="store_true", help="eagle: decoder layers with attention over the sequence's features"
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        help="heads: a reduced draft vocabulary of this many tokens, the text's most frequent (default: all; eagle3: "
        "the tokens the training text holds, at most 32768)",
    )
    p.add_argument("--samples", type=int, default=256, help="sequences the target generates (256)")
    p.add_argument(
        "--data",
        default="generated",
        choices=("generated", "text"),
        help="generated: the target continues prompts of the text; text: windows of the text itself (no generation)",
    )
    p.add_argument("--feature-layers", help="eagle3: the 3 target layers it fuses, e.g. 2,15,27 (2, L // 2, L - 3)")
    p.add_argument("--gen-len", type=int, default=224, help="tokens generated per sequence (224)")
    p.add_argument("--temperature", type=float, default=0.8, help="of the sampled sequences (0.8)")
    p.add_argument("--greedy-share", type=float, default=0.5, help="share of the sequences continued greedily (0.5)")
    p.add_argument(
        "--heldout", type=int, default=8, help="greedy sequences held out to evaluate the draft on (8; 0: none)"
    )
    p.add_argument("--eval-k", type=int, default=5, help="drafts per round of the held-out evaluation (5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--weight-values",
        default="float32",
        choices=VALUE_DTYPES,
        help="round the trained weights to this dtype's values (saved as fp32; float32: unrounded)",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def _layers(arg: str | None) -> tuple[int, ...]:
    if not arg:
        return ()
    try:
        return tuple(int(x) for x in arg.split(","))
    except ValueError:
        raise InvalidConfigError(f"--feature-layers {arg!r}: allowed 3 comma-separated layer indices") from None


def _text(path: Path | None) -> str:
    if path is None:
        from engine.demo.recipe import demo_texts

        return demo_texts()["train"]
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidConfigError(f"--text {path}: unreadable ({e})") from None


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        a = parse_args(argv)
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        opts = TrainOptions(
            kind=a.kind,
            steps=a.steps,
            layers=a.layers,
            hidden=a.hidden,
            heads=a.heads or (EAGLE3_DEPTH if a.kind == "eagle3" else 4),
            attention=a.attention,
            draft_vocab=a.draft_vocab,
            samples=a.samples,
            gen_len=a.gen_len,
            temperature=a.temperature,
            greedy_share=a.greedy_share,
            seed=a.seed,
            weight_values=a.weight_values,
            data=a.data,
            feature_layers=_layers(a.feature_layers),
        )
        text = _text(a.text)
        run = RunOptions(device=a.device, progress=not a.quiet, heldout=a.heldout, eval_k=a.eval_k)
        report = train_draft(a.target, a.out, opts, text, run)
        print(json.dumps(report, indent=2))
        return 0

    return run_tool("specmix-train-draft", body)
