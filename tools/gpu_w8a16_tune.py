#!/usr/bin/env python
"""Launch configurations of the Triton W8A16 GEMM against fp16 F.linear.

The code: engine/cli/gpu_w8a16_tune.py (the project installed).
"""

import sys

from engine.cli.gpu_w8a16_tune import main

if __name__ == "__main__":
    sys.exit(main())
