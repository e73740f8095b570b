"""Files: the specmix cache directory, sha256 of a file, and atomic writes (temp file + rename)."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    """$SPECMIX_CACHE, else $XDG_CACHE_HOME/specmix, else ~/.cache/specmix."""
    env = os.environ.get("SPECMIX_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specmix"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write bytes to a temp file beside ``path`` and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; a profile or report is meant to be read by others
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write UTF-8 text atomically (temp file beside ``path``, then rename)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON to a temp file beside ``path`` and rename it into place."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")
