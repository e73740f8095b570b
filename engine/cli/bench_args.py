"""tools/bench.py's options: the parser, --sweep-k and the plain-text prompts (--prompts or the demo's)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.core.errors import InvalidConfigError
from engine.spec_decode.registry import DRAFTERS, Loads

HEAD_KINDS = tuple(e.name for e in DRAFTERS if e.loads is Loads.HEAD)
DEFAULT_SWEEP = "1,2,4,6,8"  # --sweep-k when --plot is given
DTYPES = ("float32", "bfloat16")


def parse_args(argv: list[str] | None, doc: str | None = None) -> argparse.Namespace:
    """tools/bench.py's options (``doc``: its --help text)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path)
    p.add_argument("--draft", type=Path)
    for kind in HEAD_KINDS:
        p.add_argument(
            f"--{kind}",
            type=Path,
            dest=kind.replace("-", "_"),
            help=f"a trained {kind} head (specmix-train-draft --kind {kind}): adds the specmix-{kind} mode",
        )
    p.add_argument("--demo-size", default="demo")
    p.add_argument("--prompts", type=Path, help="one prompt per line (default: 4 from the demo held-out text)")
    p.add_argument(
        "--workload",
        type=Path,
        help="chat prompts by category, JSONL (tools/make_workload.py; examples/workload/workload.jsonl), rendered "
        "with the target's chat template; adds a table per category",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--k", type=int, default=5)
    p.add_argument(
        "--k-policy",
        default="measured",
        choices=("measured", "cost-model", "heuristic", "constant"),
        help="the drafter modes' K policy (constant: --k nodes every round, the same verify budget for each)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="the target's dtype for every mode, transformers' too (default float32; the draft stays "
        "float32 on the CPU). bfloat16 is not token-identical to float32: the table then "
        "reports each mode's greedy match rate against the float32 target",
    )
    p.add_argument("--modes", default=None, help="comma-separated subset of modes")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers modes")
    p.add_argument(
        "--attention",
        default=None,
        help="the target's attention backend (default: the engine's "
        "choice: math with --dtype bfloat16, which keeps speculation exact; sdpa is faster, not exact)",
    )
    p.add_argument(
        "--prompt-lookup",
        type=int,
        default=None,
        metavar="N",
        help="adds a mode <mode>+lookup for each drafter but ngram: prompt lookup first where the last N or more "
        "tokens recur in the context, the drafter elsewhere (speculation.prompt_lookup_min)",
    )
    p.add_argument(
        "--tree-branches",
        type=int,
        default=None,
        metavar="N",
        help="adds a mode <mode>+tree for each drafter that proposes trees (its registry entry's trees: model, "
        "ngram, medusa, eagle, eagle3, suffix) and for its +lookup mode",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path, help="write a PNG figure (needs matplotlib: pip install 'specmix[plot]')")
    p.add_argument(
        "--sweep-k",
        default=None,
        help=f"comma-separated fixed K values for the draft-model drafter and each trained head, adaptive K off "
        f"(default {DEFAULT_SWEEP} with --plot, none without; '' for none)",
    )
    return p.parse_args(argv)


def parse_sweep(a: argparse.Namespace) -> list[int]:
    spec = a.sweep_k if a.sweep_k is not None else (DEFAULT_SWEEP if a.plot else "")
    try:
        ks = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        ks = [0]
    if any(k < 1 for k in ks):
        raise InvalidConfigError(
            f"--sweep-k={spec!r} is invalid: allowed comma-separated ints >= 1, e.g. {DEFAULT_SWEEP}"
        )
    return ks


def load_prompts(a: argparse.Namespace, root: Path | None) -> list[str]:
    """--prompts' lines, else 4 paragraph openings of the demo pair's held-out text."""
    if a.prompts is not None:
        try:
            lines = [ln.strip() for ln in a.prompts.read_text(encoding="utf-8").splitlines() if ln.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidConfigError(f"--prompts {a.prompts}: unreadable ({e})") from None
        if not lines:
            raise InvalidConfigError(f"--prompts {a.prompts}: no prompts in the file")
        return lines
    if root is None:
        raise InvalidConfigError("--prompts is required with --target/--draft")
    text = (root / "heldout.txt").read_text(encoding="utf-8")
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]
    step = max(1, len(paras) // 4)
    return [paras[i * step][:160] for i in range(4)]
