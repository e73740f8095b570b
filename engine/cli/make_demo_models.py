#!/usr/bin/env python
"""Build (or find in the cache) the demo target/draft pair and print its report.

    python tools/make_demo_models.py [--size demo|tiny] [--cache-dir DIR] [--force]

Exit status 0 on success; any error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from engine.core.errors import EngineError
from engine.demo.pair import demo_pair, demo_report
from engine.demo.recipe import RECIPES


def format_report(report: dict, target: Path, draft: Path) -> str:
    """A short table of the pair's figures."""
    rows = [("model", "params", "train s", "held-out PPL")]
    for name in ("target", "draft"):
        m = report[name]
        rows.append((name, f"{m['params'] / 1e6:.2f}M", f"{m['train_s']:.1f}", f"{m['heldout_ppl']:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines += [
        f"draft/target greedy top-1 agreement (held-out, {report['eval_positions']} positions): "
        f"{report['agreement']:.3f}",
        f"vocab {report['vocab_size']}, train tokens {report['train_tokens']}, "
        f"held-out tokens {report['heldout_tokens']}, build {report['total_s']:.0f} s",
        f"target: {target}",
        f"draft:  {draft}",
    ]
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line on stderr, exit 2
        print(f"make_demo_models: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="demo", choices=sorted(RECIPES))
    ap.add_argument("--cache-dir", default=None, help="default: $SPECMIX_CACHE or ~/.cache/specmix")
    ap.add_argument("--force", action="store_true", help="rebuild even when the cache has the pair")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        target, draft = demo_pair(args.size, args.cache_dir, progress=not args.quiet, force=args.force)
        report = demo_report(args.size, args.cache_dir)
    except (EngineError, OSError) as e:
        print(f"make_demo_models: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(format_report(report, target, draft))
    return 0


if __name__ == "__main__":
    sys.exit(main())
