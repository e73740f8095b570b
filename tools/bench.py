#!/usr/bin/env python
"""Decode speed of plain, speculative and transformers generation on one pair.

The code: engine/cli/bench.py (the project installed).
"""

import sys

from engine.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
