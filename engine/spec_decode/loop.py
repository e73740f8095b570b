"""The decode loop: one speculative round over a ragged batch, as a pipeline.

Prefill and decode are the same round. Each sequence keeps its committed tokens (prompt + output) and ``tlen``
(tokens whose KV is in the target cache: len(tokens) - 1 after a round, the last sampled token is fed next
round). A round (``DecodeLoop.step``) is five steps:

1. ``plan``: each row's K_b (its controller's K within the caps and what remains), the per-row processing and
   the round's randomness, drawn up front from each sequence's own generator (engine/spec_decode/randomness.py);
2. ``draft``: the drafter proposes (``Proposal``: chains or trees), cut to each row's K_b nodes;
3. ``verify``: ONE target forward over tokens[tlen:] + drafts scores the K+1 positions from the last committed
   token on, a tree's nodes under its attention mask (engine/spec_decode/verify.py, tree.py);
4. ``accept``: the pure acceptance functions on the device (engine/spec_decode/acceptance.py); the
   one host sync of the round reads its result with a per-row non-finite flag;
5. ``commit``: stop conditions inside the accepted run, lengths moved back (a rejection is just a smaller tlen;
   a tree's accepted path moved into consecutive cache slots), the drafter told what was committed
   (``Committed``), a shared prefill handed on.

Fault isolation: a row whose scored target logits hold NaN or inf ends with finish_reason "error" (a logged
warning); the others continue. A row whose own step raises (its commit: stop checks, detokenization, its drafter's
bookkeeping) ends alone with ``Seq.failure`` set. Steps 1-4 are batched and change no sequence: when one raises,
the generators' states are restored and the exception propagates, so the round can be re-run without the rows
that caused it (the scheduler re-runs it one prefill family at a time; engine/runtime/scheduler.py). Test hooks:
``inject_nan`` (Seq -> bool) poisons the logits of the rows it picks; ``inject_fault`` ((Seq, stage) -> bool)
raises in the batched verify ("verify") or in the row's commit ("commit") for the rows it picks.

Prefill sharing: a sequence whose ``prefill_from`` names another of the same prompt (the scheduler admits the n
samples of one prompt together) takes no part in rounds until that one's first round has prefilled the prompt;
then the prompt's keys/values are copied into its row (``KVCache.copy_rows``; the drafter's state through
``Drafter.share_prefill``) and its first round scores position 0 with the target's logits (and feature) at the
prompt's last position, kept from that prefill. Its randomness is its own generator's, drawn as in a round of
its own, so its output is the one it would have had prefilling alone.

Without a drafter K is 0 and a round is a plain decode step (or the prefill). Padding tokens are written to a
scratch slot (the cache's last position), which no real position ever reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.core.forward import CachedForward, KVCache
from engine.core.tokenizer import Tokenizer
from engine.spec_decode.acceptance import Verdict, accept_round
from engine.spec_decode.chunked_prefill import prefill_chunk
from engine.spec_decode.drafter import Committed, DraftBatch, Drafter, FeatureNeed
from engine.spec_decode.k_caps import KCaps, tunable
from engine.spec_decode.penalties import needs_history
from engine.spec_decode.proposal import Proposal
from engine.spec_decode.randomness import PositionNoise, RoundNoise
from engine.spec_decode.sampling import RowProcessing
from engine.spec_decode.seq import Seq, waiting_for_prefill
from engine.spec_decode.stops import StopChecker, grammar_cut
from engine.spec_decode.structured.grammar import GrammarCompiler
from engine.spec_decode.structured.masks import GrammarRound
from engine.spec_decode.verify import Scores, verify, verify_batch

log = logging.getLogger(__name__)


@dataclass
class RoundPlan:
    """Step 1's result: the rows of the round and what they draft and draw."""

    seqs: list[Seq]  # the rows, in batch order
    ks: list[int]  # K_b per row
    processing: RowProcessing
    noise: PositionNoise | RoundNoise | None  # None: an all-greedy batch (no draws)
    waiting: dict[int, list[Seq]]  # sequences waiting for a row's prefill, by that row's id
    grammar: GrammarRound | None = None  # the rows' grammars (None: no row is constrained)
    caps: KCaps = KCaps()  # the serving layer's: whether a tree drafter drafts trees, the drafts' min acceptance

    @property
    def greedy(self) -> bool:
        return self.processing.mode == "greedy"


class _Steps(NamedTuple):
    """Steps 1-4's results, which step 5 commits row by row."""

    plan: RoundPlan
    proposal: Proposal
    scores: Scores
    verdict: Verdict
    ks: list[int]  # drafts per row in the proposal


class DecodeLoop:
    """One speculative round at a time over the sequences given (the scheduler owns which)."""

    def __init__(
        self,
        target: CachedForward,
        tokenizer: Tokenizer,
        drafter: Drafter | None,
        eos_ids: list[int],
        vocab: int,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """``target``: the target's forward (graphed where CUDA graphs are on); ``vocab``: the common vocabulary
        of draft and target (logits are cut to it); ``grammars``: compiles requests' structured outputs."""
        self.target, self.tokenizer, self.drafter, self.vocab = target, tokenizer, drafter, vocab
        self.grammars = grammars
        self.stops = StopChecker(tokenizer, eos_ids)
        self.cache: KVCache | None = None
        self.inject_nan: Callable[[Seq], bool] | None = None  # test hook: NaN logits for the rows it picks
        self.inject_fault: Callable[[Seq, str], bool] | None = None  # test hook: raise for the rows it picks

    def ensure_cache(self, rows: int, seq_len: int) -> KVCache:
        """A cache of at least ``rows`` rows and ``seq_len`` positions (the last one the scratch slot), the
        drafter's likewise: allocated, or grown keeping what every row holds (sequences may be running). Growing
        holds the old and the new tensors until the copy ends."""
        c = self.cache
        if c is not None:
            rows, seq_len = max(rows, c.max_batch), max(seq_len, c.max_seq_len)
        if self.drafter is not None:  # first: a failure then leaves the drafter's cache at least the target's
            self.drafter.ensure_cache(rows, seq_len)
        if c is None:
            c = self.cache = KVCache(self.target.config, rows, seq_len, self.target.dtype, self.target.device)
        elif c.max_batch < rows or c.max_seq_len < seq_len:
            c.grow(rows, seq_len)
            log.debug("KV cache: %d rows x %d positions (%.1f MB)", c.max_batch, c.max_seq_len, c.nbytes / 2**20)
        return c

    @property
    def position_noise(self) -> bool:
        """Whether sampled rows draw one uniform per scored position (``PositionNoise``: no drafter, or one of fixed
        tokens): a row's tokens then do not depend on its K or its drafts' shape (``k_caps.tunable``)."""
        return self.drafter is None or not self.drafter.samples

    def k_for(self, s: Seq, caps: KCaps) -> int:
        """Row K: the round's tuned K (else its controller's) within what remains and the load cap; a seeded sampled
        row whose draws depend on its K takes its own controller's K, uncapped (``tunable``). A row's first round
        (its prefill, or its start from a shared one) drafts nothing: its first token comes after the target's
        prefill alone (the drafter catches up before its next round: ``catch_up``)."""
        if self.drafter is None or s.k_ctl is None or not s.generated:
            return 0
        remaining = s.params.max_new_tokens - len(s.generated)
        if not tunable(s, self.position_noise):
            return max(0, min(s.k_ctl.k, remaining - 1))
        k = s.k_ctl.k if caps.tuned is None else caps.tuned
        return max(0, min(k, remaining - 1, caps.all))

    @torch.no_grad()
    def catch_up(self, seqs: list[Seq]) -> None:
        """The drafter feeds the prompts of rows at their first decoding step that may draft (``Drafter.catch_up``),
        finished on the device before this returns: the scheduler runs it before the round it times. A later step
        has no such row and asks the drafter nothing (a row it did not feed then catches up when it drafts)."""
        if self.drafter is None or self.cache is None:
            return
        rows = [
            s
            for s in seqs
            if len(s.generated) <= 1 and not s.finished and s.prefill_from is None and s.tlen >= len(s.prompt)
            and s.k_ctl is not None and s.params.max_new_tokens - len(s.generated) > 1
        ]  # fmt: skip
        if rows and self.drafter.catch_up(rows, self.cache.max_seq_len - 1) and self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)

    @torch.no_grad()
    def prefill(self, chunks: list[tuple[Seq, int]]) -> None:
        """Part of each joined prompt's prefill: the keys and values of each (sequence, n)'s next n prompt tokens;
        nothing is sampled (engine/spec_decode/chunked_prefill.py). A pass that raises moves no sequence."""
        assert self.cache is not None, "ensure_cache first"
        for s, _ in chunks:
            if self.inject_fault is not None and self.inject_fault(s, "prefill"):
                raise RuntimeError(f"injected fault in a prefill chunk (cache row {s.row})")
        need = self.drafter.features if self.drafter is not None else FeatureNeed.NONE
        feats = prefill_chunk(self.target, self.cache, chunks, need)
        if self.target.device.type == "cuda":  # finished before the round the K tuner times begins
            torch.cuda.synchronize(self.target.device)
        for (s, n), f in zip(chunks, feats):
            s.tlen += n
            s.stats.prefill_tokens += n
            if f is not None:
                s.prompt_features.append(f)

    @torch.no_grad()
    def step(self, seqs: list[Seq], caps: KCaps = KCaps()) -> list[tuple[Seq, list[int]]]:
        """One round over the unfinished sequences; returns each one's newly committed tokens."""
        waiting = waiting_for_prefill(seqs)
        active = [s for s in seqs if not s.finished and s.prefill_from is None]
        if not active:
            return []
        assert self.cache is not None, "ensure_cache first"
        states = [(s.generator, s.generator.get_state()) for s in active if not s.params.greedy]
        try:
            plan = self.plan(active, caps, waiting)
            proposal = self.draft(plan)
            scores = self.verify(plan, proposal)
            verdict = self.accept(plan, proposal, scores)
        except Exception:
            for g, st in states:  # the round's draws are undone: a re-run draws them again
                g.set_state(st)
            raise
        return self.commit(plan, proposal, scores, verdict)

    def plan(self, active: list[Seq], caps: KCaps, waiting: dict[int, list[Seq]]) -> RoundPlan:
        """Step 1: K_b per row, the rows' processing and the round's randomness."""
        dev = self.target.device
        # (prompt, output so far) only when a row has a penalty or min_tokens: an O(length) copy per row
        history = [(s.prompt, s.generated) for s in active] if any(needs_history(s.params) for s in active) else None
        eos = self.stops.eos_sorted
        ks = [self.k_for(s, caps) for s in active]
        grammar = self._grammar_round(active, ks)
        params = [s.params for s in active]
        proc = RowProcessing.of(params, dev, history=history, eos=eos, vocab=self.vocab, constraint=grammar)
        noise: PositionNoise | RoundNoise | None = None
        if proc.mode != "greedy":  # a greedy row draws nothing: its target and draft distributions are one-hot
            gens, sampled = [s.generator for s in active], [not s.params.greedy for s in active]
            if self.position_noise:
                noise = PositionNoise.draw(gens, ks, sampled, dev)
            else:
                noise = RoundNoise.draw(gens, ks, sampled, self.vocab, dev)
        return RoundPlan(active, ks, proc, noise, waiting, grammar, caps)

    def _grammar_round(self, active: list[Seq], ks: list[int]) -> GrammarRound | None:
        """The round's grammar work, each constrained row's matcher made on its first round."""
        if all(s.params.structured is None for s in active):
            return None
        assert self.grammars is not None, "structured outputs need the loop's grammar compiler"
        for s in active:
            if s.params.structured is not None and s.grammar is None:
                s.grammar = self.grammars.state(self.grammars.compile(s.params.structured))
        return GrammarRound([s.grammar for s in active], ks, self.vocab, self.target.device)

    def draft(self, plan: RoundPlan) -> Proposal:
        """Step 2: the drafter's chains cut to each row's K_b (none without a drafter or K)."""
        kmax, dev = max(plan.ks), self.target.device
        if kmax == 0 or self.drafter is None:
            return Proposal.empty(len(plan.seqs), dev)
        assert self.cache is not None
        row_ids = [s.row for s in plan.seqs]
        rows = None if row_ids == list(range(len(row_ids))) else torch.tensor(row_ids, device=dev)
        draft_noise = plan.noise.draft if isinstance(plan.noise, RoundNoise) else None
        window, sampled = self.target.config.sliding_window is not None, not plan.greedy
        in_order = [window or needs_history(s.params) for s in plan.seqs]  # rows that read their drafts in order
        chains = [o or (sampled and (s.grammar is not None or s.params.greedy)) for o, s in zip(in_order, plan.seqs)]
        batch = DraftBatch(
            seqs=plan.seqs, rows=rows, processing=plan.processing, k=kmax, ks=plan.ks, noise=draft_noise,
            vocab=self.vocab, scratch_pos=self.cache.max_seq_len - 1, target_cache=self.cache, device=dev,
            tree=plan.caps.tree, chains=chains, min_accept=plan.caps.min_accept if self.position_noise else 0.0,
        )  # fmt: skip
        g = plan.grammar
        if g is not None and g.all_forced:  # the grammar drafts every row: no drafter
            return g.constrain(Proposal.empty(len(plan.seqs), dev))
        prop = self.drafter.propose(batch).cut(plan.ks)
        if prop.parents is not None:  # a window or a row that reads its drafts in order takes its first branch
            drawn = prop.probs is not None
            cut = [b for b, (o, s) in enumerate(zip(in_order, plan.seqs)) if o or (drawn and s.grammar)]
            prop = prop.first_branches(cut).simplified()
        return prop if g is None else g.constrain(prop)

    def verify(self, plan: RoundPlan, proposal: Proposal) -> Scores:
        """Step 3: the target's scores, with the shared prefill's first scores in place of position 0."""
        assert self.cache is not None
        need = self.drafter.features if self.drafter is not None else FeatureNeed.NONE
        tokens, tlens = [s.tokens for s in plan.seqs], [s.tlen for s in plan.seqs]
        vb = verify_batch(tokens, tlens, proposal, [s.row for s in plan.seqs], self.cache.max_seq_len - 1, need)
        if vb.width == 0:  # every row starts from a shared prefill and drafts nothing: no target pass
            first = [s.first_scores for s in plan.seqs]
            logits = torch.stack([f[0] for f in first])[:, None]
            feats = torch.stack([f[1] for f in first])[:, None] if need is not FeatureNeed.NONE else None
            scores = Scores(logits, feats, None, vb.catch)
        else:
            scores = verify(self.target, self.cache, vb)
        for b, s in enumerate(plan.seqs):
            if self.inject_fault is not None and self.inject_fault(s, "verify"):
                raise RuntimeError(f"injected fault in the verify pass (cache row {s.row})")
            if s.first_scores is not None:
                scores.logits[b, 0] = s.first_scores[0]
                if scores.features is not None:
                    scores.features[b, 0] = s.first_scores[1]
        return scores

    def accept(self, plan: RoundPlan, proposal: Proposal, scores: Scores) -> Verdict:
        """Step 4: accept or reject every draft on the device; the round's one host sync reads the result."""
        if self.inject_nan is not None:
            for b, s in enumerate(plan.seqs):
                if self.inject_nan(s):
                    scores.logits[b, :, : self.vocab] = float("nan")
        lp_rows = {b: s.params.logprobs for b, s in enumerate(plan.seqs) if s.params.logprobs is not None}
        return accept_round(proposal, scores, plan.processing, plan.noise, self.vocab, lp_rows)

    def commit(
        self, plan: RoundPlan, proposal: Proposal, scores: Scores, verdict: Verdict
    ) -> list[tuple[Seq, list[int]]]:
        """Step 5: each row's committed tokens, its drafter told, a shared prefill handed on."""
        steps = _Steps(plan, proposal, scores, verdict, proposal.row_counts())
        events: list[tuple[Seq, list[int]]] = []
        for b, s in enumerate(plan.seqs):
            s.first_scores = None
            s.stats.prefill_tokens += max(0, len(s.prompt) - s.tlen)
            if verdict.bad[b]:
                self._fail_row(s, "non-finite target logits")
                events.append((s, []))
                continue
            try:
                events.append((s, self._commit_row(b, s, steps)))
            except Exception as e:  # noqa: BLE001 - this row's own step failed: it ends alone, the others go on
                log.exception("the commit of cache row %d raised: ending its request alone", s.row)
                s.failure = f"{type(e).__name__}: {e}"
                self._fail_row(s, s.failure)
                events.append((s, []))
        return events

    def _commit_row(self, b: int, s: Seq, steps: _Steps) -> list[int]:
        """Row b's accepted run committed: lengths, its drafter told, a shared prefill handed on, stops cut."""
        plan, verdict = steps.plan, steps.verdict
        if self.inject_fault is not None and self.inject_fault(s, "commit"):
            raise RuntimeError(f"injected fault in the commit of cache row {s.row}")
        new, k = verdict.tokens[b], steps.ks[b]
        n_before, a = len(s.tokens), len(verdict.tokens[b]) - 1
        s.tlen = n_before + a
        if isinstance(plan.noise, PositionNoise):  # its generator after the draws of the tokens it commits
            plan.noise.rewind(b, s.generator, a + 1)
        if verdict.paths is not None and self.cache is not None:  # the accepted nodes into consecutive slots
            path = verdict.paths[b]
            self.cache.move(s.row, [n_before + n for n in path], list(range(n_before, n_before + len(path))))
        if self.drafter is not None:
            g = plan.grammar  # the drafter proposed this row's drafts this round (not a grammar)
            ran = max(plan.ks) > 0 and (g is None or not (g.all_forced or g.forced[b]))
            feats = verdict.row_features(b, a, self.drafter.features, steps.scores)
            if s.prompt_features and feats is not None:  # the prompt's positions prefilled in chunks first
                feats, s.prompt_features = torch.cat([*s.prompt_features, feats]), []
            self.drafter.commit(s, Committed(n_before, a, max(plan.ks), ran, feats, k))
        if id(s) in plan.waiting:
            self._share_prefill(s, plan.waiting[id(s)], steps.scores, b)
        s.stats.record(k, a)
        first = None if verdict.firsts is None else verdict.firsts[b]
        s.stats.tree_rounds += first is not None and first[0] < k  # a row with branches (not cut to a chain)
        if s.k_ctl is not None and k > 0:  # a tree's row: as the chain along its first branch would have fared
            s.k_ctl.update(*((k, a) if first is None else first))
        if plan.grammar is not None and s.grammar is not None:
            new = grammar_cut(s, plan.grammar, b, new, a)
        kept = self.stops.cut(s, new)
        if s.logprobs is not None:
            s.logprobs.extend(verdict.logprobs[b][: len(kept)])
        s.tokens.extend(kept)
        return kept

    def _fail_row(self, s: Seq, why: str) -> None:
        log.warning(
            "%s in the row of a %d-token sequence (cache row %d) after %d generated tokens: "
            "ending it with finish_reason 'error'",
            why,
            len(s.prompt),
            s.row,
            len(s.generated),
        )
        s.finish("error")
        self.clear_row(s.row)

    def clear_row(self, row: int) -> None:
        """Zero a cache row whose keys/values may be non-finite: a later sequence in it must not read them
        (the math attention reads a bucket of slots past kv_len, masked, and 0 * NaN is NaN)."""
        if self.cache is not None:
            self.cache.k[:, row].zero_()
            self.cache.v[:, row].zero_()

    def _share_prefill(self, src: Seq, dst: list[Seq], scores: Scores, b: int) -> None:
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
        logits = scores.logits[b, 0]
        feats = None if scores.features is None else scores.features[b, 0]
        for s in dst:
            s.tlen, s.prefill_from = n, None
            s.first_scores = (logits.clone(), None if feats is None else feats.clone())
            s.stats.prefill_shared += n

    def final_text(self, s: Seq) -> str:
        """The output text (decoded once, at the end, unless stop strings had it decoded on the way)."""
        return self.stops.final_text(s)
