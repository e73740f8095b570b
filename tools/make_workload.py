#!/usr/bin/env python
"""Build the benchmark workload (chat, code-edit, qa, json prompts from CPython's docs and sources) as JSONL.

The code: engine/cli/make_workload.py (the project installed).
"""

import sys

from engine.cli.make_workload import main

if __name__ == "__main__":
    sys.exit(main())
