#!/usr/bin/env python
"""Tokens/s and memory of a model unquantized against its precision plan, each mode in its own process.

The code: engine/cli/bench_int8.py (the project installed).
"""

import sys

from engine.cli.bench_int8 import main

if __name__ == "__main__":
    sys.exit(main())
