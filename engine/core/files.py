"""Files: the specmix cache directory, sha256 of a file, and atomic writes (temp file + rename)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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


HASH_RECORD = ".specmix-sha256.json"  # beside the weights: {file name: {size, mtime_ns, inode, sha256}}
log = logging.getLogger(__name__)


def verified_sha256(path: Path, full: bool = False) -> str:
    """The sha256 of ``path``, read from the record beside it while its size, mtime and inode are unchanged.

    A file whose stat differs from its record (or ``full``) is read and hashed again and the record
    rewritten (atomically; a read-only directory logs that every start will re-hash). The record guards
    against weights that changed or were replaced, not against someone who forges the record too.
    """
    path = Path(path)
    st = path.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
    rec_file = path.parent / HASH_RECORD
    records: dict[str, Any] = {}
    if rec_file.is_file():
        try:
            loaded = json.loads(rec_file.read_text(encoding="utf-8"))
            records = loaded if isinstance(loaded, dict) else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            log.warning("%s is unreadable (%s): hashing the weights again", rec_file, e)
    rec = records.get(path.name)
    if (
        not full
        and isinstance(rec, dict)
        and isinstance(rec.get("sha256"), str)
        and all(rec.get(k) == v for k, v in stamp.items())
    ):
        return rec["sha256"]
    digest = sha256_file(path)
    records[path.name] = {**stamp, "sha256": digest}
    try:
        write_json_atomic(rec_file, records)
    except OSError as e:
        log.info("could not write %s (%s): the next start hashes %s again", rec_file, e, path.name)
    return digest


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


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created when missing) for the block: one builder of a cache entry
    at a time across processes."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
