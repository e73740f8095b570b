#!/usr/bin/env python
"""Structured outputs (a JSON schema) with and without speculation on one target.

The code: engine/cli/bench_structured.py (the project installed).
"""

import sys

from engine.cli.bench_structured import main

if __name__ == "__main__":
    sys.exit(main())
