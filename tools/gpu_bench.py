#!/usr/bin/env python
"""Decode-step figures of the GPU path on random weights (no checkpoint, no network).

The code: engine/cli/gpu_bench.py (the project installed).
"""

import sys

from engine.cli.gpu_bench import main

if __name__ == "__main__":
    sys.exit(main())
