#!/usr/bin/env python
"""Fetch SmolLM2-135M-Instruct into the specmix cache as an HF checkpoint.

The code: engine/cli/fetch_smollm.py (the project installed).
"""

import sys

from engine.cli.fetch_smollm import main

if __name__ == "__main__":
    sys.exit(main())
