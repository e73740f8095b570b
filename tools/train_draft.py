#!/usr/bin/env python
"""Train a draft for any target: a draft model, Medusa heads or an EAGLE-style head.

The code: engine/cli/train_draft.py (the project installed).
"""

import sys

from engine.cli.train_draft import main

if __name__ == "__main__":
    sys.exit(main())
