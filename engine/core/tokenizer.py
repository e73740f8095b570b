"""The tokenizer of a checkpoint (``tokenizer.json`` through the ``tokenizers`` library)."""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from engine.core.errors import CheckpointError

log = logging.getLogger(__name__)


class TextStream:
    """Incremental detokenization that never raises: tokenizers' DecodeStream until it fails, then a window.

    DecodeStream raises on some byte sequences (a prefix its decoder later rewrites). From then on the stream
    decodes a window of the last tokens itself: the text of ``ids[prefix:]`` less that of ``ids[prefix:read]``,
    held back while it ends in a partial character. Text handed out is never taken back.
    """

    _WINDOW = 5  # tokens of context before the read offset (enough for a byte-level character's 4 bytes)

    def __init__(self, tok: _HFTokenizer, skip_special_tokens: bool) -> None:
        self._tok, self._skip = tok, skip_special_tokens
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._prefix = self._read = 0  # the window's offsets into _ids: text is handed out up to _read
        self.resets = 0  # times DecodeStream failed

    def step(self, ids: int | list[int]) -> str:
        """The text that ``ids`` complete after those seen before ("" when none yet)."""
        new = [ids] if isinstance(ids, int) else list(ids)
        self._ids.extend(new)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._tok, new) or ""
            except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception: decode by window
                self.resets += 1
                log.warning("incremental decoding failed (%s); decoding by window from here", e)
                self._stream = None
                self._prefix = max(0, self._read - self._WINDOW)
            else:
                if piece:  # DecodeStream hands out the text of every id so far at once
                    self._read = len(self._ids)
                return piece
        return self._window()

    def _window(self) -> str:
        before = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        text = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = max(self._prefix, len(self._ids) - self._WINDOW), len(self._ids)
        return text[len(before) :]


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

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what a grammar engine reads it from)."""
        return self._tok.to_str()

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
