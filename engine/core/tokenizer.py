"""The tokenizer of a checkpoint (``tokenizer.json`` through the ``tokenizers`` library)."""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from engine.core.errors import CheckpointError

log = logging.getLogger(__name__)


class TextStream:
    """Incremental detokenization that never raises: tokenizers' DecodeStream, reset when it fails.

    DecodeStream raises on some byte sequences (a prefix its decoder later rewrites). Then the stream
    is rebuilt over every id seen so far and the new text is what the whole decode adds to the text
    already handed out; text handed out is never taken back.
    """

    def __init__(self, tok: _HFTokenizer, skip_special_tokens: bool) -> None:
        self._tok, self._skip = tok, skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._text = ""  # text handed out so far
        self.resets = 0  # times the stream was rebuilt

    def step(self, ids: int | list[int]) -> str:
        """The text that ``ids`` complete after those seen before ("" when none yet)."""
        new = [ids] if isinstance(ids, int) else list(ids)
        self._ids.extend(new)
        try:
            piece = self._stream.step(self._tok, new) or ""
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception; reset and re-decode
            return self._reset(e)
        self._text += piece
        return piece

    def _reset(self, err: Exception) -> str:
        self.resets += 1
        log.warning("incremental decoding failed (%s); re-decoding %d tokens", err, len(self._ids))
        self._stream = DecodeStream(ids=list(self._ids), skip_special_tokens=self._skip)
        full = self._tok.decode(self._ids, skip_special_tokens=self._skip).rstrip("\ufffd")
        piece = full[len(self._text) :] if full.startswith(self._text) else ""
        self._text += piece
        return piece


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        f = p / "tokenizer.json" if p.is_dir() else p
        if not f.is_file():
            raise CheckpointError(f"{f}: tokenizer.json is missing")
        try:
            self._tok = _HFTokenizer.from_file(str(f))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise CheckpointError(f"{f}: invalid tokenizer.json ({e})") from None
        self.path = f

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def id_bound(self) -> int:
        """One past the largest id the tokenizer can produce, added tokens included."""
        return max(self.vocab().values(), default=-1) + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a prompt rendered by a chat template already holds its special tokens:
        encode it with add_special_tokens=False (else a second BOS)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode_stream(self, skip_special_tokens: bool = True) -> TextStream:
        """An incremental decoder: feed it with ``step``; the text of the new tokens only, never a partial
        UTF-8 character, and never an exception (it resets itself; ``TextStream``)."""
        return TextStream(self._tok, skip_special_tokens)

    def step(self, stream: TextStream, ids: int | list[int]) -> str | None:
        """The text that ``ids`` (appended to what ``stream`` has seen) complete; None when none yet."""
        return stream.step(ids) or None
