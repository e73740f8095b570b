"""The EAGLE-3 drafter: the head of engine/spec_decode/heads/eagle3.py, drafting through a KV cache of its own.

At build it asks the target for the hidden states entering its feature layers (``Transformer.use_feature_layers``):
the verify pass returns them, concatenated, as the features of every committed position (``FeatureNeed.ALL``), in
the same forward. ``commit`` fuses them (the head's fc, 3H -> H) before keeping them, so the rest is the EAGLE
head with attention's round (drafters/eagle_attn.py): the committed entries catch the head's cache up, each later
draft is one entry more on the head's own output. Drafts are scored by the head's own norm and reduced-vocabulary
LM head and mapped to the target's ids (``d2t``); sampled rows return their processed distributions, which the
core's exact acceptance reads. Chains, and with ``tree_branches`` > 1 trees as the attention head drafts them; the layer
and scores on the CPU kernels' one-call step where they run (``DraftKernels.eagle3_step``), else on PyTorch's ops;
CUDA graphs are refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from torch import Tensor

from engine.core.errors import InvalidConfigError
from engine.spec_decode.drafter import Committed, DrafterContext
from engine.spec_decode.drafters.eagle_attn import EagleAttnDrafter, tree_width
from engine.spec_decode.heads.eagle3 import Eagle3Head

if TYPE_CHECKING:
    from engine.spec_decode.seq import Seq


class Eagle3Drafter(EagleAttnDrafter):
    """Fused multi-layer features in, drafts over the head's draft vocabulary out."""

    head: Eagle3Head  # type: ignore[assignment]

    @classmethod
    def build(cls, ctx: DrafterContext) -> Eagle3Drafter:
        if ctx.kernels.cuda_graphs:
            raise InvalidConfigError("CUDA graphs of the EAGLE-3 head are not built: cuda_graphs=False for this head")
        assert ctx.head is not None and isinstance(ctx.head.module, Eagle3Head), "the entry loads an EAGLE-3 head"
        ctx.target_module.use_feature_layers(ctx.head.config.feature_layers)
        kernel = ctx.kernels.eagle3_step(ctx.head.module)
        lm_head = ctx.head.module.lm_head
        d = cls(ctx.head, ctx.target_module, lm_head if kernel is not None else ctx.kernels.scorer(lm_head), kernel)
        d.branches = tree_width(ctx, lm_head.weight.shape[0])
        return d

    def embed(self, tokens: Tensor) -> Tensor:
        """The head's own embedding where its checkpoint has one, else the target's."""
        own = self.head.embed_tokens
        return (self.target.embed_tokens if own is None else own)(tokens)

    def scores(self, f: Tensor) -> Tensor:
        """The layer's outputs [..., H] -> logits over the draft vocabulary [..., V'] (the head's norm, LM head)."""
        return self.lm_head(self.head.norm(f))

    def commit(self, seq: Seq, outcome: Committed) -> None:
        if outcome.features is not None:  # the target's [m, 3H] hidden states -> the head's [m, H] features
            outcome = replace(outcome, features=self.head.fuse(outcome.features))
        super().commit(seq, outcome)
