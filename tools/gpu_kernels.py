#!/usr/bin/env python
"""The GPU's copy and matmul ceilings and the quantized Linears' kernels against fp16.

The code: engine/cli/gpu_kernels.py (the project installed).
"""

import sys

from engine.cli.gpu_kernels import main

if __name__ == "__main__":
    sys.exit(main())
