"""Continuous batching: one worker thread owns the decode loop and the KV caches.

Callers (any thread) validate their request, then ``submit`` it and wait on its
``Request`` handle; they never touch the loop. The worker, per round:

1. drops cancelled requests (waiting or running) and frees their cache rows;
2. admits waiting requests in FIFO order into free rows (at most ``max_batch``
   run at once); requests of the same prompt admitted together (the ``n``
   samples of one prompt, submitted together) share one prefill: the first
   prefills, the others wait for it and start from a copy (engine/spec_decode/loop.py);
3. runs ``DecodeLoop.step`` over every running sequence: the requests that
   joined this round first (their prefill, and their first tokens handed out),
   then the others' decode; while others decode, a round prefills at most ``prefill_chunk``
   prompt tokens per token a decoding row gets (``PrefillPace``, engine/spec_decode/chunked_prefill.py),
   a prefill begun first, then the prompts in the order they came;
4. hands each request its new tokens; a finished request leaves and frees its row.

Cache policy: the cache holds what the running sequences use, not what they may use (engine/runtime/
kv_growth.py); the wait queue and the rows: engine/runtime/admission.py.

Faults: a round that raises changes no sequence (engine/spec_decode/loop.py): it is re-run one prefill family
at a time, and only the requests whose rows fail alone end with ``RequestFailedError``; the others go on as if
nothing happened. The worker logs it and keeps serving; health turns unhealthy only after rounds in which no
request could run. The worker exits after ``idle_exit_s`` without work (so an unused Engine can be collected)
and is restarted by the next submission; at interpreter exit it cancels what is left and ends between rounds
(it is not a daemon, so no torch op is cut off).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.errors import EngineError
from engine.runtime import isolation
from engine.runtime.admission import Admission, PrefillPace, SchedulerLimits
from engine.runtime.draft_cost import DraftCost
from engine.runtime.k_tuner import Arm, KTuner
from engine.runtime.kv_growth import CacheUse, fit
from engine.runtime.request import Completion, Request, RequestFailedError, Totals
from engine.runtime.telemetry import LoadGovernor
from engine.runtime.tuned_rounds import TunedRows, controller, round_arm, round_caps
from engine.spec_decode.adaptive import Costs, KPolicy
from engine.spec_decode.chunked_prefill import split_prefill
from engine.spec_decode.k_caps import NO_CAP, KCaps
from engine.spec_decode.loop import DecodeLoop
from engine.spec_decode.sampling import SamplingParams
from engine.spec_decode.seq import Seq

log = logging.getLogger(__name__)


@dataclass
class _Running:
    """A request in the running batch and its sequence (the worker's)."""

    request: Request
    seq: Seq


class Scheduler:
    """The worker thread, its wait queue, the cache rows and the engine-wide counters."""

    def __init__(
        self,
        loop: DecodeLoop,
        limits: SchedulerLimits,
        *,
        policy: KPolicy | None,
        costs: Callable[[], Costs | None],
        device: torch.device,
        governor: LoadGovernor | None = None,
        tuner: KTuner | None = None,
    ) -> None:
        """``loop`` runs the rounds; ``policy`` (None: plain decoding) and ``costs`` (called once, when the
        first cost-model controller is made) build each sequence's K controller; ``governor`` is the load
        window (None: no caps)."""
        self.loop, self.tokenizer, self.policy, self._costs, self.device = loop, loop.tokenizer, policy, costs, device
        self.max_batch = limits.max_batch
        self.idle_exit_s, self.pace = limits.idle_exit_s, PrefillPace(limits.prefill_chunk)  # (prefill budget)
        self.k_max = policy.k_max if policy is not None else 0
        self.totals = Totals()
        self._lock = threading.Condition()
        self.rows = Admission(limits.max_batch, limits.max_waiting)  # the wait queue and the cache rows (the lock's)
        self._running: list[_Running] = []  # the worker's; read elsewhere only for len()
        self._thread: threading.Thread | None = None
        self._driver = threading.Lock()  # held by whichever thread runs a round (the worker or a caller)
        self._callers = 0  # callers driving rounds themselves (generate); the worker stands by meanwhile
        self.governor = governor
        self.tuner = tuner  # the round's K from measured rounds (None: each sequence's own controller)
        self.draft_cost = DraftCost()  # with the tuner: the acceptance a draft token needs at the running batch
        self.batch_cap = limits.max_batch  # admitted sequences at most (the load window lowers it)
        self.k_cap = NO_CAP  # the load window's K cap of the last round (lowered under GPU memory pressure)
        self.on_round: Callable[[], None] | None = None  # test hook, called before each step (its errors: the step's)
        self._round_started: float | None = None  # monotonic start of the round in progress
        self._failed_streak = 0  # rounds that raised since the last one that did not

    # ------------------------------------------------------------ submission
    def submit(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], drive: bool = False
    ) -> list[Request]:
        """Queue the (validated) prompts together, or refuse them all with OverloadedError.
        ``drive``: the caller will run rounds itself (``drive``), counted before the worker can start."""
        reqs = [Request(p, sp, self.tokenizer, self.wake, self._completion) for p, sp in zip(prompts, params)]
        with self._lock:
            if len(reqs) > self.rows.room():
                self.totals.rejected_overload += len(reqs)
                raise self.rows.overloaded(len(reqs))
            self.rows.waiting.extend(reqs)
            self._callers += drive
            if self._thread is None:
                # not a daemon: at interpreter exit it cancels what runs and ends between rounds
                self._thread = threading.Thread(target=self._run, name="specmix-worker", daemon=False)
                self._thread.start()
            self._lock.notify_all()
        return reqs

    def wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def queue_length(self) -> int:
        return len(self.rows.waiting)

    def running_requests(self) -> list[Request]:
        """A copy of the running batch (for gauges)."""
        return [r.request for r in self._running]

    def running(self) -> int:
        return len(self._running)

    # ------------------------------------------------------------ driving rounds
    # Rounds run in the worker thread, or in a caller that waits for its requests (generate): on the
    # CPU, an OpenMP team in a second thread is throttled (libgomp stops spinning when its threads
    # outnumber the cores), so a round there is slower than one in the thread that loaded the model.
    # The worker stands by while a caller drives; one lock keeps rounds one at a time.

    def drive(self, reqs: Sequence[Request]) -> None:
        """Run rounds in this thread until ``reqs`` are done (they were submitted with drive=True)."""
        try:
            while not all(r.done() for r in reqs):
                with self._driver:
                    worked = not all(r.done() for r in reqs) and self._work_once()
                if not worked:  # nothing ran (our requests wait for rows): wait without holding the rounds
                    with self._lock:
                        self._lock.wait(0.01)
        finally:
            with self._lock:
                self._callers -= 1
                self._lock.notify_all()

    def _work_once(self) -> bool:
        """Admit what fits, start it, run one round; False when there was nothing to run."""
        with self._lock:
            self._drop_cancelled_waiting()
            admitted = self.rows.admit(self.batch_cap)
        first: dict[tuple[int, ...], Seq] = {}  # the first sequence of each prompt admitted: it prefills for the rest
        for r, row in admitted:
            try:
                s = self._start(r, row, first.get(tuple(r.prompt)))
            except Exception as e:  # noqa: BLE001 - e.g. measuring costs failed: fail it, keep serving
                log.exception("could not start a request")
                self._free(row)
                with self._lock:
                    self.totals.failed += 1
                r.deliver([], error=RequestFailedError(f"request could not start: {type(e).__name__}: {e}"))
                continue
            first.setdefault(tuple(r.prompt), s)
            self._running.append(_Running(r, s))
        if not self._running:
            return False
        self._round()
        return True

    def _run(self) -> None:
        try:
            while True:
                if not threading.main_thread().is_alive():  # interpreter shutdown: stop, leave no torch op running
                    with self._driver:
                        self._cancel_all()
                    return
                with self._lock:
                    if self._callers:  # a caller drives: stand by
                        self._lock.wait(0.05)
                        continue
                with self._driver:
                    worked = self._work_once()
                if not worked:
                    with self._lock:
                        if self._callers:
                            continue
                        if not self.rows.waiting:
                            self._lock.wait(self.idle_exit_s)
                            self._drop_cancelled_waiting()
                            if not self.rows.waiting and not self._callers and not self._running:
                                self._thread = None
                                return
                        else:  # the head waits for rows; a round of others frees them
                            self._lock.wait(0.01)
        finally:
            with self._lock:  # a dying worker (a bug, SystemExit) lets the next submission start a new one
                if self._thread is threading.current_thread():
                    self._thread = None

    def _cancel_all(self) -> None:
        for r in list(self.rows.waiting) + [x.request for x in self._running]:
            r.cancel()
        with self._lock:
            self._drop_cancelled_waiting()
        for x in list(self._running):
            x.seq.finish("cancelled")
            self._retire(x)

    def _drop_cancelled_waiting(self) -> None:
        for r in self.rows.drop_cancelled():
            self._finish_unstarted(r)

    def _start(self, r: Request, row: int, sibling: Seq | None) -> Seq:
        """The request's sequence in ``row``: its seeded generator and K controller (outside the lock: costs may be
        measured); ``sibling``: the first admitted sequence of the same prompt, whose prefill it shares."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(r.params.seed if r.params.seed is not None else secrets.randbits(63))
        k_ctl = controller(self.policy, self.tuner, r.params, self.loop.position_noise, self._costs)
        return Seq(prompt=r.prompt, params=r.params, generator=gen, row=row, k_ctl=k_ctl, prefill_from=sibling)

    def _free(self, row: int) -> None:
        with self._lock:
            self.rows.release(row)
            self._lock.notify_all()

    def _round(self) -> None:
        """One round: the sequences that join prefill first (their first tokens out without waiting for the others'
        decode), then every running sequence decodes, the joined ones included, each step one ``DecodeLoop.step``;
        the decoding step runs at the arm the tuner chose (and is what it measures)."""
        for x in [x for x in self._running if x.request.cancelled]:
            x.seq.finish("cancelled")
            self._retire(x)
        if not self._running:
            return
        if self.governor is not None:  # GPU memory pressure lowers K and the admitted batch, never fails
            self.k_cap, self.batch_cap = self.governor.poll()
        self._fit_cache()
        if not self._running:
            return
        self._running.sort(key=lambda x: x.seq.row)
        joining = [x for x in self._running if x.seq.tlen < len(x.seq.prompt)]  # (with those waiting for a prefill)
        new = [x.seq for x in sorted(joining, key=lambda x: x.request.submitted_at)]  # the budget's order: not by row
        if new:  # a budget of prompt tokens only while others decode
            split = split_prefill(new, self.pace.budget(self.k_cap) if len(new) < len(self._running) else None)
            if split.chunks:
                self._prefill(split.chunks)
            if split.finish:  # their first step drafts nothing (DecodeLoop.k_for)
                self._run_part(split.finish, KCaps(all=self.k_cap), None)
        # (those that ended or failed in the prefill step have left; those in their prefill wait)
        running = [x.seq for x in self._running if x.seq.tlen >= len(x.seq.prompt)]
        if running:
            arm = round_arm(self.tuner, running, self.loop.position_noise)
            cut = self.policy is not None and self.policy.draft_cut  # whether rounds ask the draft cost's cut
            caps = round_caps(arm, self.draft_cost if cut else None, len(running), self.k_cap)
            self._run_part(running, caps, arm)

    def _fit_cache(self) -> None:
        """Grow the cache, keeping every row, to hold this round of every running sequence (engine/runtime/
        kv_growth.py). When the memory for that size is not there, the exact size this round needs is tried; when
        that fails too, the requests that needed the room end with RequestFailedError and the others go on."""
        use = CacheUse.of([x.seq for x in self._running], self.k_max)
        have, why = fit(self.loop, use, self.max_batch)
        if why is None:
            return
        for x in list(self._running):
            if not CacheUse.of([x.seq], self.k_max).fits(have):
                self._retire(x, RequestFailedError(why))

    def _run_part(self, seqs: list[Seq], caps: KCaps, arm: Arm | None) -> None:
        """One step over ``seqs`` (isolating the rows that fail), its time told the tuner and the draft cost where
        ``arm`` (the tuner's) is given and no row prefills, its tokens handed out. The drafter's catch-up on joined
        prompts runs first, outside the time told."""
        prefill = any(s.tlen < len(s.prompt) for s in seqs)  # costs the same at any K: the tuner does not measure it
        tuned = None if arm is None or self.tuner is None else TunedRows.of(seqs, arm, self.loop.position_noise)
        t0 = t1 = time.perf_counter()
        self._round_started = time.monotonic()
        rounds, clean = 1, True
        try:
            if self.on_round is not None:
                self.on_round()
            self.loop.catch_up(seqs)  # the drafter's prompt feeding, outside the time the tuner reads
            t1 = time.perf_counter()
            events = self.loop.step(seqs, caps)
        except Exception as e:  # noqa: BLE001 - the one place: isolate the rows that fail, keep serving
            events, rounds = self._isolate(seqs, caps, e)
            clean = False  # rounds of parts of the batch: not a measurement of the batch
        finally:
            self._round_started = None
        t2 = time.perf_counter()
        if tuned is not None and clean and not prefill and self.tuner is not None:
            tuned.teach(self.tuner, self.draft_cost, seqs, events, t2 - t1)
        if clean and not prefill:
            self.pace.record(len(seqs), sum(len(toks) for _, toks in events))
        with self._lock:
            if clean:
                self._failed_streak = 0
            self.totals.seconds += t2 - t0
            self.totals.target_forwards += rounds
            self.totals.plain_rounds += arm is not None and arm.k == 0
        self._hand_out(events)

    def _prefill(self, chunks: list[tuple[Seq, int]]) -> None:
        """Chunks of joined prompts' prefills; a pass that raises (and moved no sequence) is re-run one sequence at
        a time, and a sequence whose chunk fails alone ends with RequestFailedError."""
        t0 = time.perf_counter()
        self._round_started = time.monotonic()
        rerun = None
        try:
            self.loop.prefill(chunks)
        except Exception as e:  # noqa: BLE001 - isolate the sequences that fail, keep serving
            log.warning("a prefill chunk over %d sequences raised (%s); re-running it by sequence", len(chunks), e)
            rerun = isolation.by_sequence(self.loop, chunks, e)
        finally:
            self._round_started = None
        with self._lock:
            self.totals.seconds += time.perf_counter() - t0
            self.totals.target_forwards += 1
        if rerun is not None:
            self._settle(rerun)

    def _isolate(self, seqs: list[Seq], caps: KCaps, e: Exception) -> tuple[list[tuple[Seq, list[int]]], int]:
        """A round over ``seqs`` raised (and changed none of them): re-run it one prefill family at a time, so that
        only the rows that fail alone end with an error (engine/runtime/isolation.py). The streak of failed rounds
        (health) grows only when no family could run: a fault of the engine."""
        log.warning("a decode round over %d sequences raised (%s: %s); re-running it by family", len(seqs),
                    type(e).__name__, e)  # fmt: skip
        rerun = isolation.by_family(self.loop, seqs, caps, e)
        self._settle(rerun)
        return rerun.events, max(1, rerun.ran)

    def _settle(self, rerun: isolation.Rerun) -> None:
        """The failed parts of a re-run step end their requests; the streak of failed rounds (health) grows only
        when no part could run."""
        with self._lock:
            self.totals.round_failures += len(rerun.failed)
            self._failed_streak = 0 if rerun.ran else self._failed_streak + 1
        for part, err in rerun.failed:
            self._fail_seqs(part, err)

    def _fail_seqs(self, seqs: list[Seq], e: Exception) -> None:
        log.error("a round over %d sequences failed; ending their requests", len(seqs), exc_info=e)
        err = RequestFailedError(f"generation failed in a decode round: {type(e).__name__}: {e}")
        ids = {id(s) for s in seqs}
        for x in [x for x in self._running if id(x.seq) in ids]:
            self.loop.clear_row(x.seq.row)
            self._retire(x, err)

    def _hand_out(self, events: list[tuple[Seq, list[int]]]) -> None:
        """Each request its new tokens; a finished one leaves the batch."""
        by_seq = {id(s): toks for s, toks in events}
        for x in list(self._running):
            new = by_seq.get(id(x.seq), [])
            if x.seq.failure is not None:
                self._retire(x, RequestFailedError(f"generation failed for this request: {x.seq.failure}"))
            elif x.seq.finished:
                self._retire(x, new=new)
            elif new:
                x.request.deliver(new, x.seq.logprobs[-len(new) :] if x.seq.logprobs is not None else ())

    def _retire(self, x: _Running, error: EngineError | None = None, new: Sequence[int] = ()) -> None:
        """Leave the batch: free the row, account, hand the caller its completion (or error)."""
        s = x.seq
        self._running.remove(x)
        with self._lock:
            self.rows.release(s.row)
            if error is None:
                self.totals.count(s)
            else:
                self.totals.failed += 1
            self._lock.notify_all()
        lps = s.logprobs[-len(new) :] if new and s.logprobs is not None and error is None else ()
        x.request.deliver(list(new), lps, final=None if error else s, error=error)

    def _completion(self, s: Seq) -> Completion:
        return Completion.of(s, self.loop.final_text(s))

    def _finish_unstarted(self, r: Request) -> None:
        self.totals.requests += 1
        self.totals.finished["cancelled"] += 1
        r.deliver([], completion=Completion.unstarted(r.prompt))

    def health(self, stall_s: float, max_failed_rounds: int) -> str | None:
        """What keeps the engine from making progress, or None: a round running longer than ``stall_s``,
        ``max_failed_rounds`` rounds in a row that raised, or pending requests without a thread to run them."""
        started = self._round_started
        if started is not None and time.monotonic() - started > stall_s:
            return f"a decode round has run for {time.monotonic() - started:.0f} s (stall limit {stall_s:g} s)"
        with self._lock:
            if self._failed_streak >= max_failed_rounds:
                return f"the last {self._failed_streak} decode rounds failed (limit {max_failed_rounds})"
            if (self.rows.waiting or self._running) and self._thread is None and not self._callers:
                return f"{len(self.rows.waiting) + len(self._running)} requests are pending but no worker runs them"
        return None

    def reset_totals(self) -> None:
        with self._lock:
            self.totals = Totals()

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of the counters plus the queue gauges."""
        with self._lock:
            return {
                "totals": self.totals.copy(),
                "waiting": len(self.rows.waiting),
                "running": self.rows.held,
            }
