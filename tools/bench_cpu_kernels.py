#!/usr/bin/env python
"""Time the CPU few-row GEMMs per weight storage (fp32, fp16, int8 per channel and per group), weights streamed.

The code: engine/cli/bench_cpu_kernels.py (the project installed).
"""

import sys

from engine.cli.bench_cpu_kernels import main

if __name__ == "__main__":
    sys.exit(main())
