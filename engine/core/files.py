"""Files: the specmix cache directory, sha256 of a file, atomic writes (temp file + rename), checkpoint
directories written config last, and cache directories built aside and swapped in by rename."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.core.errors import CheckpointError


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


def _staged(path: Path, write: Callable[[Path], None]) -> Path:
    """A temp file beside ``path`` that ``write`` filled, flushed to disk (mode 0644); removed if ``write`` raises."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o644)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_file_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` fills a temp file beside ``path`` (it is given the temp file's path), which is flushed to disk
    and renamed into place: a reader sees the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _staged(path, write)
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_checkpoint_files(
    directory: Path, files: Mapping[str, Callable[[Path], None]], config: str, config_text: str
) -> None:
    """Write a checkpoint directory so that a reader who sees its config sees complete files.

    Each of ``files`` (name -> a writer of that file at the path it is given) is written to a temp file
    beside its place and flushed; then the old ``config`` is removed, the files are renamed into place, and
    ``config`` is written last (atomically). A failure while writing the files leaves the directory as it
    was; one after the old config is removed leaves no config (no checkpoint), never a config beside weights
    it does not describe.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    staged: dict[str, Path] = {}
    try:
        for name, write in files.items():
            staged[name] = _staged(directory / name, write)
        (directory / config).unlink(missing_ok=True)
        for name in list(staged):
            os.replace(staged[name], directory / name)
            del staged[name]
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    write_text_atomic(directory / config, config_text)


def clear_leftovers(final: Path, complete: Callable[[Path], bool]) -> None:
    """Handle what an interrupted build of the cache directory ``final`` left (``cached_dir`` calls it under its lock).

    Staging directories (``.<name>.tmp-*``) are removed; a complete directory moved aside by a swap that
    did not finish (``.<name>.old-*``) is put back when ``final`` is missing or incomplete, else removed; an
    incomplete ``final`` (``complete`` says no) is removed.
    """
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        log.warning("removing %s (left by an interrupted build)", tmp)
        shutil.rmtree(tmp)
    for old in sorted(final.parent.glob(f".{final.name}.old-*")):
        if complete(old) and not complete(final):
            if final.exists():
                shutil.rmtree(final)
            log.warning("restoring %s from %s (moved aside by an interrupted rebuild)", final, old)
            os.rename(old, final)
        else:
            shutil.rmtree(old)
    if final.exists() and not complete(final):
        log.warning("removing %s: incomplete (left by an older or interrupted build)", final)
        shutil.rmtree(final)


def cached_dir(
    final: Path, build: Callable[[Path], None], complete: Callable[[Path], bool], force: bool = False
) -> Path:
    """The cache directory ``final``, built first when ``complete`` says it is not (or when ``force``).

    Under a lock beside it (one builder at a time across processes), leftovers of interrupted builds are
    handled (``clear_leftovers``), then ``build`` writes into a fresh staging directory beside ``final``.
    Only once it returns and ``complete`` accepts the result is ``final`` replaced: an existing one is
    renamed aside, the new one renamed into place, the old one removed. A build that raises leaves
    ``final`` as it was (an older complete directory stays usable) and no staging directory.
    """
    final = Path(final)
    if not force and complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        clear_leftovers(final, complete)
        if force or not complete(final):
            _build_and_swap(final, build, complete)
    return final


def _build_and_swap(final: Path, build: Callable[[Path], None], complete: Callable[[Path], bool]) -> None:
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        build(tmp)
        if not complete(tmp):
            raise CheckpointError(f"the build of {final} finished without its complete contents (in {tmp})")
        if final.exists():
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
