#!/usr/bin/env python
"""An OpenAI-compatible server over a profile or a checkpoint (the ``specmix-serve`` console script).

The code: engine/cli/serve.py (the project installed; the server needs the ``serve`` extra).
"""

import sys

from engine.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
