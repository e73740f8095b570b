"""The decode loop: one speculative round over a ragged batch.

Prefill and decode are the same round. Each sequence keeps its committed tokens
(prompt + output), ``tlen`` (tokens whose KV is in the target cache, always
len(tokens) - 1 after a round: the last sampled token is fed next round) and
``dlen`` (the same for the draft model). A round:

1. draws this round's randomness from each sequence's own generator (so a seed
   gives the same output whatever else is in the batch);
2. lets the drafter propose K_b tokens per row (K_b from the row's controller);
3. runs ONE target forward over tokens[tlen:] + drafts, scoring the K+1
   positions from the last committed token on;
4. runs the pure acceptance function on the device; the one host sync of the
   round is reading its result;
5. applies stop conditions inside the accepted run, moves lengths back (a
   rejection is just a smaller tlen: stale cache slots are overwritten later).

Fault isolation: a row whose scored target logits hold NaN or inf ends with
finish_reason "error" (a logged warning); the check is a [B] flag computed on
the device and read in the same single host synchronisation. ``inject_nan``
(a test hook: Seq -> bool) poisons the logits of the rows it picks.

Prefill sharing: a sequence whose ``prefill_from`` names another of the same prompt (the scheduler admits
the n samples of one prompt together) takes no part in rounds until that one's first round has prefilled
the prompt; then the prompt's keys/values are copied into its row (``KVCache.copy_rows``; the drafter's
state through ``Drafter.share_prefill``) and its first round scores position 0 with the target's logits
(and feature) at the prompt's last position, kept from that prefill. Its randomness is its own generator's,
drawn as in a round of its own, so its output is the one it would have had prefilling alone.

Without a drafter K is 0 and a round is a plain decode step (or the prefill).
Padding tokens are written to a scratch slot (the cache's last position),
which no real position ever reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from engine.core.model import KVCache, Transformer
from engine.core.tokenizer import Tokenizer
from engine.spec_decode.drafters.base import DraftBatch, Drafter
from engine.spec_decode.penalties import needs_history
from engine.spec_decode.rejection import greedy_accept, rejection_sample
from engine.spec_decode.sampling import RowProcessing
from engine.spec_decode.seq import Seq, token_logprobs, waiting_for_prefill

log = logging.getLogger(__name__)


class DecodeLoop:
    def __init__(
        self,
        target: Transformer,
        tokenizer: Tokenizer,
        drafter: Drafter | None,
        eos_ids: list[int],
        vocab: int,
        device: torch.device,
    ) -> None:
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.eos = set(eos_ids)
        self._eos_sorted = sorted(self.eos)
        self.vocab, self.device = vocab, device
        self.cache: KVCache | None = None
        self.inject_nan: Callable[[Seq], bool] | None = None  # test hook: NaN logits for the rows it picks
        self.k_cap = 1 << 30  # the load window (engine/runtime/telemetry.py) lowers it under GPU memory pressure
        # the batch window (serve/window.py) caps greedy rows only: a sampled row's K decides which
        # random draws it makes, so capping it would make a seed's output depend on the rest of the batch
        self.greedy_k_cap = 1 << 30

    def ensure_cache(self, rows: int, positions: int, k_max: int) -> KVCache:
        """A cache with >= rows rows and room for `positions` + K headroom + the scratch slot."""
        need = positions + k_max + 2
        c = self.cache
        if c is None or c.max_batch < rows or c.max_seq_len < need:
            seq_len = -(-need // 128) * 128
            if c is not None:
                seq_len = max(seq_len, c.max_seq_len)
                rows = max(rows, c.max_batch)
            self.cache = None  # free before allocating the bigger one
            w = self.target.norm.weight
            self.cache = KVCache(self.target.config, rows, seq_len, w.dtype, w.device)
            log.debug("allocated KV cache rows=%d seq_len=%d (%.1f MB)", rows, seq_len, self.cache.nbytes / 2**20)
        if self.drafter is not None:
            self.drafter.ensure_cache(self.cache.max_batch, self.cache.max_seq_len)
        return self.cache

    def k_for(self, s: Seq) -> int:
        if self.drafter is None or s.k_ctl is None:
            return 0
        remaining = s.params.max_new_tokens - len(s.generated)
        cap = min(self.k_cap, self.greedy_k_cap) if s.params.greedy else self.k_cap
        return max(0, min(s.k_ctl.k, remaining - 1, cap))

    @torch.no_grad()
    def step(self, seqs: list[Seq]) -> list[tuple[Seq, list[int]]]:
        """One round over the unfinished sequences; returns each one's newly committed tokens."""
        waiting = waiting_for_prefill(seqs)
        active = [s for s in seqs if not s.finished and s.prefill_from is None]
        if not active:
            return []
        cache = self.cache
        assert cache is not None, "ensure_cache first"
        dev, V, B = self.device, self.vocab, len(active)
        scratch = cache.max_seq_len - 1
        row_ids = [s.row for s in active]
        rows = None if row_ids == list(range(B)) else torch.tensor(row_ids, device=dev)
        proc = RowProcessing.of(
            [s.params for s in active],
            dev,
            # (prompt, output so far) only when a row has a penalty or min_tokens: an O(length) copy per row
            history=[(s.prompt, s.generated) for s in active] if any(needs_history(s.params) for s in active) else None,
            eos=self._eos_sorted,
            vocab=V,
        )
        ks = [self.k_for(s) for s in active]
        kmax = max(ks)

        # this round's randomness, drawn up front from each sequence's own generator (a greedy row uses
        # none: its target and draft distributions are one-hot; an all-greedy batch allocates none)
        greedy = proc.mode == "greedy"
        final_noise = uniforms = draft_noise = None
        if not greedy:
            final_noise = torch.ones(B, V, device=dev)
            uniforms = torch.full((B, kmax), 0.5, device=dev)
            draft_noise = torch.ones(B, kmax, V, device=dev)
            for b, s in enumerate(active):
                if s.params.greedy:
                    continue
                if ks[b]:
                    draft_noise[b, : ks[b]].exponential_(generator=s.generator)
                    uniforms[b, : ks[b]].uniform_(generator=s.generator)
                final_noise[b].exponential_(generator=s.generator)

        drafts = torch.zeros(B, 0, dtype=torch.long, device=dev)
        dprobs: Tensor | None = None
        proposed = 0
        if kmax > 0:
            assert self.drafter is not None
            batch = DraftBatch(active, rows, proc, kmax, draft_noise, V, scratch, cache, ks)
            drafts, dprobs, num = self.drafter.propose(batch)
            proposed = kmax
            if num is not None:  # a deterministic drafter may find fewer
                ks = [min(k, n) for k, n in zip(ks, num)]
                kmax = max(ks)
                drafts = drafts[:, :kmax]
                uniforms = None if uniforms is None else uniforms[:, :kmax]
                dprobs = None if dprobs is None else dprobs[:, :kmax]

        # one verify pass over tokens[tlen:] + drafts
        catch = [len(s.tokens) - s.tlen for s in active]
        T = max(catch) + kmax
        toks = torch.zeros(B, T, dtype=torch.long)
        pos = torch.full((B, T), scratch, dtype=torch.long)
        for b, s in enumerate(active):
            toks[b, : catch[b]] = torch.tensor(s.tokens[s.tlen :], dtype=torch.long)
            pos[b, : catch[b] + ks[b]] = torch.arange(s.tlen, s.tlen + catch[b] + ks[b])
        toks, pos = toks.to(dev), pos.to(dev)
        catch_t = torch.tensor(catch, dtype=torch.long, device=dev)
        if kmax:
            cols = catch_t[:, None] + torch.arange(kmax, device=dev)
            toks.scatter_(1, cols, drafts)
        # [B, K+1]; a row whose prompt was copied (catch 0) has its first scores from the shared prefill
        idx = ((catch_t - 1)[:, None] + torch.arange(kmax + 1, device=dev)).clamp_(min=0)
        aligned = rows is None and len({s.tlen for s in active}) == 1 and all(c + k == T for c, k in zip(catch, ks))
        want_feats = getattr(self.drafter, "needs_features", False)
        want_all = getattr(self.drafter, "needs_all_features", False)  # every committed position's, not the last's
        feats: Tensor | None = None
        prefix: Tensor | None = None  # [B, T, H] the features of every column (a prefill round, want_all)
        if T == 0:  # every row starts from a shared prefill and drafts nothing: no target pass
            logits = torch.stack([s.first_scores[0] for s in active])[:, None]
            feats = torch.stack([s.first_scores[1] for s in active])[:, None] if want_feats else None
        else:
            logits, feats, prefix = self._verify(
                active, toks, pos, idx, catch, ks, kmax, rows, aligned, want_feats, want_all
            )
        for b, s in enumerate(active):
            if s.first_scores is not None:
                logits[b, 0] = s.first_scores[0]
                if feats is not None:
                    feats[b, 0] = s.first_scores[1]
                s.first_scores = None
            s.stats.prefill_tokens += max(0, len(s.prompt) - s.tlen)
        first_scores = (logits[:, 0], None if feats is None else feats[:, 0])  # for sequences waiting on a prefill
        if self.inject_nan is not None:
            for b, s in enumerate(active):
                if self.inject_nan(s):
                    logits[b] = float("nan")
        num_draft = torch.tensor(ks, dtype=torch.long, device=dev)
        scored = torch.arange(kmax + 1, device=dev) <= num_draft[:, None]  # [B, K+1] positions that count
        bad = ((~torch.isfinite(logits[..., :V])).any(-1) & scored).any(-1)  # [B] non-finite rows
        if greedy:  # one-hot q: accept while d == argmax q, else take argmax q (whatever p is); no distributions
            out, nacc = greedy_accept(drafts, logits[..., :V].argmax(-1), num_draft)
        else:
            assert uniforms is not None and final_noise is not None
            q = proc.probs_at(logits[..., :V], drafts, 0)  # [B, K+1, V], penalties per draft position
            out, nacc = rejection_sample(drafts, dprobs, q, num_draft, uniforms, final_noise)
        feats_k = feats  # [B, K+1, H]: column j is position tlen + catch - 1 + j
        if feats is not None:  # the feature that scored each row's new last token (position of its a-th draft)
            feats = feats[torch.arange(B, device=dev), nacc]
        res = torch.cat([out, nacc[:, None], bad[:, None].to(out.dtype)], 1).tolist()  # the one host sync
        lp_rows = {b: s.params.logprobs for b, s in enumerate(active) if s.params.logprobs is not None}
        lps = token_logprobs(logits[..., :V], out, lp_rows) if lp_rows else {}

        events = []
        for b, s in enumerate(active):
            if res[b][-1]:
                log.warning(
                    "non-finite target logits in the row of a %d-token sequence (cache row %d) after "
                    "%d generated tokens: ending it with finish_reason 'error'",
                    len(s.prompt),
                    s.row,
                    len(s.generated),
                )
                s.finish("error")
                # its keys/values may be non-finite too: a later sequence in this row must not read them
                # (the math attention reads a bucket of slots past kv_len, masked, and 0 * NaN is NaN)
                cache.k[:, s.row].zero_()
                cache.v[:, s.row].zero_()
                events.append((s, []))
                continue
            n_before, a, k = len(s.tokens), res[b][-2], ks[b]
            s.tlen = n_before + a
            if feats is not None:
                s.feature = feats[b]
            if want_all and feats_k is not None:  # positions tlen .. the new tlen - 1
                new = feats_k[b, : a + 1]
                if catch[b] > 1:
                    assert prefix is not None
                    new = torch.cat([prefix[b, : catch[b] - 1], new])
                s.new_features.append(new)
            if proposed and self.drafter is not None:
                self.drafter.after_verify(s, n_before, a, proposed)
            if id(s) in waiting:
                f0 = first_scores[1]
                self._share_prefill(s, waiting[id(s)], first_scores[0][b], None if f0 is None else f0[b])
            s.stats.record(k, a)
            if s.k_ctl is not None and k > 0:
                s.k_ctl.update(k, a)
            kept = self._stop_checks(s, res[b][: a + 1])
            if s.logprobs is not None:
                s.logprobs.extend(lps[b][: len(kept)])
            s.tokens.extend(kept)
            events.append((s, kept))
        return events

    def _verify(
        self,
        active: list[Seq],
        toks: Tensor,  # [B, T] catch-up tokens then drafts, padded
        pos: Tensor,  # [B, T] their positions (padding: the scratch slot)
        idx: Tensor,  # [B, K+1] the scored columns
        catch: list[int],
        ks: list[int],
        kmax: int,
        rows: Tensor | None,  # [B] cache rows (None: 0..B-1)
        aligned: bool,
        want_feats: bool,
        want_all: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The target's scores [B, K+1, V] (and features [B, K+1, H] for a head; with ``want_all`` and a row that
        prefills, also every column's features [B, T, H]). A round where some rows prefill (a prompt of tens of
        tokens) beside rows that decode (K+1 tokens) runs them as two passes: one padded pass would compute every
        decoding row at the prompt's width."""
        T, B = toks.shape[1], len(active)
        every = want_all and max(catch) > 1  # a row prefills: every column's features (the prompt's) are wanted
        wide = [b for b in range(B) if catch[b] > 1]
        narrow = [b for b in range(B) if catch[b] <= 1]
        t_narrow = max((catch[b] for b in narrow), default=0) + kmax
        if not (wide and narrow and t_narrow > 0 and len(narrow) * (T - t_narrow) > B):  # (0: nothing to run)
            kv_len = max(s.tlen + c + k for s, c, k in zip(active, catch, ks))
            start = active[0].tlen if aligned else None
            res = self.target(
                toks,
                pos,
                self.cache,
                kv_len,
                rows,
                logits_idx=idx,
                start=start,
                return_hidden=want_feats,
                hidden_all=every,
            )
            if not want_feats:
                return res, None, None
            if every:
                return res[0], _at(res[1], idx), res[1]
            return (*res, None)
        logits: Tensor | None = None
        feats: Tensor | None = None
        prefix: Tensor | None = None
        for g in (wide, narrow):
            sel = torch.tensor(g, device=toks.device)
            t_g = max(catch[b] for b in g) + kmax
            kv_len = max(active[b].tlen + catch[b] + ks[b] for b in g)
            g_rows = torch.tensor([active[b].row for b in g], device=toks.device)
            res = self.target(
                toks[sel, :t_g],
                pos[sel, :t_g],
                self.cache,
                kv_len,
                g_rows,
                logits_idx=idx[sel],
                return_hidden=want_feats,
                hidden_all=every and g is wide,
            )
            lg, ft = res if want_feats else (res, None)
            if every and g is wide:
                assert ft is not None
                prefix = ft.new_zeros(B, T, ft.shape[-1])
                prefix[sel, :t_g] = ft
                ft = _at(ft, idx[sel])
            if logits is None:
                logits = lg.new_empty(B, *lg.shape[1:])
                feats = None if ft is None else ft.new_empty(B, *ft.shape[1:])
            logits[sel] = lg
            if feats is not None:
                feats[sel] = ft
        assert logits is not None
        return logits, feats, prefix

    def _share_prefill(self, src: Seq, dst: list[Seq], logits: Tensor, feats: Tensor | None) -> None:
        """``src`` has prefilled its prompt this round: its keys/values of the prompt go into the rows of ``dst``
        (the drafter's state too, where it can copy it), whose first round is then scored from ``src``'s logits
        (and feature) at the prompt's last position. Each samples with its own generator, as if it had
        prefilled alone."""
        n = len(src.prompt)
        dst = [s for s in dst if not s.finished]
        assert self.cache is not None
        self.cache.copy_rows(src.row, [s.row for s in dst], n)
        if self.drafter is not None:
            self.drafter.share_prefill(src, dst, n)
        for s in dst:
            s.tlen, s.prefill_from = n, None
            s.first_scores = (logits.clone(), None if feats is None else feats.clone())
            s.stats.prefill_shared += n

    def _stop_checks(self, s: Seq, new: list[int]) -> list[int]:
        """Cut the accepted run at a stop token, max_new_tokens or a stop string; finish the sequence.

        Stop strings are searched in the text decoded incrementally (the cost is the new tokens'), and
        only once min_tokens tokens are out; the text keeps nothing of a stop token or a stop string.
        """
        sp = s.params
        stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos)
        remaining = sp.max_new_tokens - len(s.generated)
        stops, done = sp.stop, len(s.generated)
        if stops and s.decoder is None:
            s.decoder = self.tokenizer.decode_stream()
        longest = max((len(x) for x in stops), default=0)
        kept: list[int] = []
        for t in new:
            kept.append(t)
            if t in stop_ids:
                s.stop_token = t in sp.stop_token_ids
                if stops and s.stop_token:
                    s.stop_cut = len(s.text)
                s.finish("stop")
                return kept
            if stops:
                piece = self.tokenizer.step(s.decoder, t)
                if piece:
                    start = max(0, len(s.text) - longest + 1)
                    s.text += piece
                    if done + len(kept) >= sp.min_tokens:
                        hits = [i for i in (s.text.find(x, start) for x in stops) if i >= 0]
                        if hits:
                            s.stop_cut = min(hits)
                            s.finish("stop")
                            return kept
            if len(kept) >= remaining:
                s.finish("length")
                return kept
        return kept

    def final_text(self, s: Seq) -> str:
        """The output text (decoded once, at the end, unless stop strings had it decoded on the way)."""
        if s.params.stop:
            return s.text if s.stop_cut is None else s.text[: s.stop_cut]
        return self.tokenizer.decode(s.generated[:-1] if s.stop_token else s.generated)


def _at(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, T, H] at the columns idx [B, J] -> [B, J, H]."""
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))
