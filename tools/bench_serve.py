#!/usr/bin/env python
"""Serving benchmark against an OpenAI-compatible specmix server (the ``specmix-bench-serve`` console script).

The code: engine/cli/bench_serve.py (the project installed; the server needs the ``serve`` extra).
"""

import sys

from engine.cli.bench_serve import main

if __name__ == "__main__":
    sys.exit(main())
