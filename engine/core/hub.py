"""Models by name: a local checkpoint directory, or a Hugging Face Hub id resolved through huggingface_hub.

Only the files an engine reads are fetched (safetensors weights, JSON configs, the tokenizer and a
chat template); pickled weights only for a draft without safetensors (``draft=True``: published EAGLE heads
ship ``pytorch_model.bin``, which the head loader reads as tensors only). ``offline`` (or ``HF_HUB_OFFLINE=1``)
uses the local cache only; a model that neither the cache nor the Hub provides is a CheckpointError naming both.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from engine.core.errors import CheckpointError, InvalidConfigError

log = logging.getLogger(__name__)

HUB_FILES = ("*.safetensors", "*.json", "chat_template.jinja")
HEAD_FILES = ("pytorch_model.bin",)  # a draft head's weights besides safetensors (tensors only, weights_only)


@dataclass(frozen=True)
class HubOptions:
    """Where ``Engine.from_pretrained`` resolves Hub ids (``owner/name``) of the target and the draft."""

    cache_dir: str | Path | None = None
    """The huggingface_hub cache (None: its default, HF_HUB_CACHE)."""
    offline: bool | None = None
    """Only the local cache (None: HF_HUB_OFFLINE)."""
    revision: str | None = None
    """The target's branch, tag or commit (None: main)."""
    draft_revision: str | None = None
    """The draft's (None: main)."""

    def __post_init__(self) -> None:
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, Path)):
            raise InvalidConfigError(f"hub.cache_dir={self.cache_dir!r:.60} is invalid: allowed a path or None")
        if self.offline is not None and not isinstance(self.offline, bool):
            raise InvalidConfigError(f"hub.offline={self.offline!r:.60} is invalid: allowed a bool or None")
        for name, v in (("revision", self.revision), ("draft_revision", self.draft_revision)):
            if v is not None and not (isinstance(v, str) and v):
                raise InvalidConfigError(f"hub.{name}={v!r:.60} is invalid: allowed a non-empty str or None")


def resolve_ref(ref: str | Path, hub: HubOptions, *, draft: bool = False) -> str | Path:
    """A Hub id's local snapshot (``resolve_model``); anything else as it is (a local path, checked where read)."""
    if not is_hub_id(str(ref)):
        return ref
    revision = hub.draft_revision if draft else hub.revision
    return resolve_model(ref, cache_dir=hub.cache_dir, offline=hub.offline, revision=revision, draft=draft)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


def is_hub_id(ref: str) -> bool:
    """``owner/name`` that is not an existing local path."""
    return bool(_HUB_ID.match(ref)) and not Path(ref).exists()


def resolve_model(
    ref: str | Path,
    *,
    cache_dir: str | Path | None = None,
    offline: bool | None = None,
    revision: str | None = None,
    draft: bool = False,
) -> Path:
    """The local directory of ``ref``: the path itself, or the Hub snapshot of an ``owner/name`` id (``draft``: a
    draft model or head, whose weights may also be ``pytorch_model.bin``)."""
    p = Path(ref)
    if p.exists() or not is_hub_id(str(ref)):
        if not p.is_dir():
            raise CheckpointError(f"{ref}: no such checkpoint directory (and not a Hub id owner/name)")
        return p
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    cache = None if cache_dir is None else str(cache_dir)
    try:
        d = snapshot_download(str(ref), revision=revision, cache_dir=cache, allow_patterns=list(HUB_FILES),
                              local_files_only=offline)  # fmt: skip
        if draft and not any(Path(d).glob("*.safetensors")):  # a head published with pickled weights only
            d = snapshot_download(str(ref), revision=revision, cache_dir=cache, allow_patterns=list(HEAD_FILES),
                                  local_files_only=offline)  # fmt: skip
    except LocalEntryNotFoundError:
        where = "the local cache (offline mode)" if offline else "the local cache nor the Hub (network unreachable?)"
        raise CheckpointError(
            f"{ref}: a Hub id that neither {where} provides; cache_dir={cache_dir or 'the default HF cache'}"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(f"{ref}: could not be fetched from the Hub: {e}") from None
    path = Path(d)
    if not any(path.glob("*.safetensors")) and not (draft and any((path / f).is_file() for f in HEAD_FILES)):
        allowed = "safetensors or a head's pytorch_model.bin" if draft else "only safetensors are loaded"
        raise CheckpointError(f"{ref}: the snapshot {path} has no .safetensors weights ({allowed})")
    log.info("model %s resolved to %s%s", ref, path, " (offline)" if offline else "")
    return path
