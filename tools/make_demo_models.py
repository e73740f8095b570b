#!/usr/bin/env python
"""Build (or find in the cache) the demo target/draft pair and print its report.

The code: engine/cli/make_demo_models.py (the project installed).
"""

import sys

from engine.cli.make_demo_models import main

if __name__ == "__main__":
    sys.exit(main())
