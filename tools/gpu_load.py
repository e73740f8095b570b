#!/usr/bin/env python
"""Engine load and decode on a GPU-sized random checkpoint written on the spot.

The code: engine/cli/gpu_load.py (the project installed).
"""

import sys

from engine.cli.gpu_load import main

if __name__ == "__main__":
    sys.exit(main())
