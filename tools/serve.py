"""An OpenAI-compatible server (the ``specmix-serve`` console script): see engine/api/serve_cli.py.

    python tools/serve.py --profile FILE
    python tools/serve.py --target DIR|owner/name [--draft DIR|owner/name] [--port 8000]
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.api.serve_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
