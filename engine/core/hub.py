"""Models by name: a local checkpoint directory, or a Hugging Face Hub id resolved through huggingface_hub.

Only the files an engine reads are fetched (safetensors weights, JSON configs, the tokenizer and a
chat template), never pickled weights. ``offline`` (or ``HF_HUB_OFFLINE=1``) uses the local cache
only; a model that neither the cache nor the Hub provides is a CheckpointError naming both.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from engine.core.errors import CheckpointError

log = logging.getLogger(__name__)

HUB_FILES = ("*.safetensors", "*.json", "chat_template.jinja")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


def is_hub_id(ref: str) -> bool:
    """``owner/name`` that is not an existing local path."""
    return bool(_HUB_ID.match(ref)) and not Path(ref).exists()


def resolve_model(
    ref: str | Path, *, cache_dir: str | Path | None = None, offline: bool | None = None, revision: str | None = None
) -> Path:
    """The local directory of ``ref``: the path itself, or the Hub snapshot of an ``owner/name`` id."""
    p = Path(ref)
    if p.exists() or not is_hub_id(str(ref)):
        if not p.is_dir():
            raise CheckpointError(f"{ref}: no such checkpoint directory (and not a Hub id owner/name)")
        return p
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        d = snapshot_download(
            str(ref),
            revision=revision,
            cache_dir=None if cache_dir is None else str(cache_dir),
            allow_patterns=list(HUB_FILES),
            local_files_only=offline,
        )
    except LocalEntryNotFoundError:
        where = "the local cache (offline mode)" if offline else "the local cache nor the Hub (network unreachable?)"
        raise CheckpointError(
            f"{ref}: a Hub id that neither {where} provides; cache_dir={cache_dir or 'the default HF cache'}"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(f"{ref}: could not be fetched from the Hub: {e}") from None
    path = Path(d)
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(f"{ref}: the snapshot {path} has no .safetensors weights (only safetensors are loaded)")
    log.info("model %s resolved to %s%s", ref, path, " (offline)" if offline else "")
    return path
