#!/usr/bin/env python
"""Plan precision for a GPU, quantize, gate on perplexity/KLD, calibrate K, write a profile.

The code: engine/cli/build_profile.py (the project installed).
"""

import sys

from engine.cli.build_profile import main

if __name__ == "__main__":
    sys.exit(main())
