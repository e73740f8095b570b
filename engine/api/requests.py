"""What a request must be before it is queued: prompts as token ids of the model's vocabulary, one SamplingParams
per prompt, and a length the context and the KV cache can hold. Every refusal is an InvalidRequestError naming
the field and what is allowed; nothing that passes here can fail inside a round because of its values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.errors import InvalidRequestError
from engine.core.tokenizer import Tokenizer
from engine.spec_decode.sampling import SamplingParams
from engine.spec_decode.structured.grammar import GrammarCompiler

Prompts = str | Sequence[str] | Sequence[Sequence[int]]


def is_id_list(p: object) -> bool:
    """True for a non-empty list or tuple of ints (one prompt of token ids)."""
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(t, int) for t in p)


@dataclass(frozen=True)
class RequestChecks:
    """The engine's limits a request is checked against."""

    tokenizer: Tokenizer
    """Encodes text prompts."""
    vocab: int
    """Token ids allowed: 0 .. vocab - 1 (the logits' width)."""
    context: int
    """The model's context (max_position_embeddings)."""
    max_seq_len: int
    """Prompt + max_new_tokens a request may hold (Limits.max_seq_len, at most the context)."""
    k_max: int
    """The widest K (only named in messages: the cache holds max_seq_len + k_max + 2 positions per row)."""
    grammars: GrammarCompiler | None = None
    """Compiles structured outputs (a request's grammar is compiled, and refused when invalid, before it queues)."""

    def prompt_ids(self, prompts: Prompts) -> list[list[int]]:
        """Token ids per prompt; text is encoded, id lists are checked against the vocabulary."""
        allowed = "a str, a non-empty list of str, or a non-empty list of token-id lists"
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise InvalidRequestError(f"prompts={prompts!r:.80} is invalid: allowed {allowed}")
        return [self._one_prompt(i, p) for i, p in enumerate(prompts)]

    def _one_prompt(self, i: int, p: object) -> list[int]:
        V = self.vocab
        if isinstance(p, str):
            if not p:
                raise InvalidRequestError(f"prompts[{i}] is an empty string: a prompt needs >= 1 token")
            ids = self.tokenizer.encode(p)
        elif isinstance(p, (list, tuple)):
            ids = list(p)
            for j, t in enumerate(ids):
                if not isinstance(t, int) or isinstance(t, bool):
                    raise InvalidRequestError(f"prompts[{i}][{j}]={t!r:.40} is invalid: allowed an int token id")
                if not 0 <= t < V:
                    raise InvalidRequestError(
                        f"prompts[{i}][{j}]={t} is out of range: allowed token ids 0..{V - 1} (vocab {V})"
                    )
        else:
            raise InvalidRequestError(f"prompts[{i}]={p!r:.80} is invalid: allowed a str or a list of token ids")
        if not ids:
            raise InvalidRequestError(f"prompts[{i}] is empty: a prompt needs >= 1 token")
        return ids

    def token_tensor(self, ids: torch.Tensor) -> torch.Tensor:
        """A [B, T] tensor of token ids, checked: an integer dtype, ids in the vocabulary, T within the context."""
        if ids.dim() != 2 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise InvalidRequestError(
                f"token_ids has shape {tuple(ids.shape)} and dtype {ids.dtype}: allowed [B, T] integer ids"
            )
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.vocab):
            raise InvalidRequestError(f"token_ids holds ids outside 0..{self.vocab - 1} (vocab {self.vocab})")
        if ids.shape[1] > self.context:
            raise InvalidRequestError(f"token_ids has {ids.shape[1]} tokens, beyond the context of {self.context}")
        return ids.long()

    @staticmethod
    def params(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        """One SamplingParams per prompt (the default, one for all, or one each)."""
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params):
            if len(params) != n:
                raise InvalidRequestError(
                    f"params has {len(params)} entries for {n} prompts: allowed one SamplingParams or one per prompt"
                )
            return list(params)
        raise InvalidRequestError(f"params={params!r:.80} is invalid: allowed a SamplingParams or a list of them")

    def check(self, prompts: Prompts, params: Any) -> tuple[list[list[int]], list[SamplingParams]]:
        """Prompt ids and per-prompt params, refusing ids beyond the vocabulary and what cannot fit the context
        or the cache."""
        ids = self.prompt_ids(prompts)
        plist = self.params(params, len(ids))
        for i, (p, sp) in enumerate(zip(ids, plist)):
            beyond = [t for t in sp.stop_token_ids if t >= self.vocab]
            if beyond:
                raise InvalidRequestError(
                    f"SamplingParams.stop_token_ids={beyond[0]} (in request {i}) is out of range: "
                    f"allowed token ids 0..{self.vocab - 1} (vocab {self.vocab})"
                )
            self._check_length(i, len(p), sp.max_new_tokens)
            if sp.structured is not None:
                if self.grammars is None:
                    raise InvalidRequestError("SamplingParams.structured is not supported by this engine")
                self.grammars.compile(sp.structured)
        return ids, plist

    def _check_length(self, i: int, prompt_len: int, max_new: int) -> None:
        n = prompt_len + max_new
        if n > self.context:  # drafts never pass prompt + max_new_tokens - 1: K is capped by what remains
            raise InvalidRequestError(
                f"prompts[{i}] has {prompt_len} tokens + max_new_tokens {max_new} = "
                f"{n}, beyond the model's context of {self.context} tokens"
            )
        if n > self.max_seq_len:
            raise InvalidRequestError(
                f"prompts[{i}] has {prompt_len} tokens + max_new_tokens {max_new} = {n}, beyond the "
                f"engine's max_seq_len={self.max_seq_len} (a KV cache row grows to at most max_seq_len + k_max "
                f"{self.k_max} + 2 positions)"
            )
