"""The tokenizer of a checkpoint (``tokenizer.json`` through the ``tokenizers`` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from engine.core.errors import CheckpointError


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a prompt rendered by a chat template already holds its special tokens:
        encode it with add_special_tokens=False (else a second BOS)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        """An incremental decoder (tokenizers' DecodeStream): feed it with ``step``; the text of the new
        tokens only, never a partial UTF-8 character."""
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, stream: DecodeStream, ids: int | list[int]) -> str | None:
        """The text that ``ids`` (appended to what ``stream`` has seen) complete; None when none yet."""
        return stream.step(self._tok, ids)
