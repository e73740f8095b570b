#!/usr/bin/env python
"""Export a profile's planned draft and target as ONNX graphs of one decode/verify step.

The code: engine/cli/export_onnx.py (the project installed).
"""

import sys

from engine.cli.export_onnx import main

if __name__ == "__main__":
    sys.exit(main())
