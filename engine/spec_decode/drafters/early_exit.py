"""Self-speculation: the target's first L layers, with its final norm and LM head, draft.

The drafter writes the target's own cache (layers < L): the verify pass rewrites the same positions with
the same tokens, so nothing needs undoing after a round and a shared prefill is the target's copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.core.errors import InvalidConfigError
from engine.core.forward import CachedForward, KVCache
from engine.spec_decode.costs import cached_forward
from engine.spec_decode.drafter import Committed, DraftBatch, DrafterContext
from engine.spec_decode.drafters.draft_model import ModelDrafter

if TYPE_CHECKING:
    from engine.core.model import Transformer
    from engine.spec_decode.seq import Seq


class EarlyExitDrafter(ModelDrafter):
    """The target's first ``n_layers`` layers drafting into the target's cache."""

    def __init__(self, target: CachedForward, module: Transformer, n_layers: int) -> None:
        super().__init__(target, module, n_layers)

    @classmethod
    def build(cls, ctx: DrafterContext) -> EarlyExitDrafter:
        n = ctx.target.config.num_hidden_layers
        layers = ctx.options.get("early_exit_layers")
        L = layers if layers is not None else max(1, n // 4)
        if not 1 <= L < n:
            raise InvalidConfigError(f"speculation.early_exit_layers={L!r} is invalid: allowed 1..{n - 1}")
        return cls(ctx.target, ctx.target_module, L)

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        pass  # uses the target's cache

    def _cache(self, batch: DraftBatch) -> KVCache:
        return batch.target_cache

    def _start(self, seq: Seq) -> int:
        # a sequence whose prompt's keys/values were copied (tlen == len(tokens)) feeds its last token again
        return min(seq.tlen, len(seq.tokens) - 1)

    def commit(self, seq: Seq, outcome: Committed) -> None:
        pass  # the verify pass rewrote every position the drafter wrote

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        pass  # its cache is the target's, which the loop copies

    def catch_up(self, seqs: list[Seq], scratch_pos: int) -> int:
        return 0  # the target's prefill wrote its layers' keys and values

    def cost_step(self, batch: int) -> Callable[[], object] | None:
        return cached_forward(self.module, 1, batch=batch, n_layers=self.n_layers)
