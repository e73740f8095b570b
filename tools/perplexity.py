#!/usr/bin/env python
"""Recompute a profile's quality gate: the regression check to put in CI.

The code: engine/cli/perplexity.py (the project installed).
"""

import sys

from engine.cli.perplexity import main

if __name__ == "__main__":
    sys.exit(main())
