"""What the command-line tools share: argument errors as one line, and their exit codes
(0 ok, 1 a check failed, 2 bad input or a refused build, 130 interrupted)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from engine.core.errors import EngineError


class ArgumentError(EngineError, ValueError):
    """A command-line argument is invalid."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises ArgumentError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ArgumentError(message)


def run_tool(prog: str, body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """body()'s exit code; an EngineError (ArgumentError included) prints ``prog: message`` and gives 2,
    Ctrl-C prints ``prog: interrupted`` and gives 130. No traceback either way."""
    try:
        return body()
    except EngineError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130
