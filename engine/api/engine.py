"""The public Engine: load a target (and a drafter), generate, stream, score."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.api.assemble import Parts, assemble, resolve_device
from engine.api.build_thread import build_off_thread
from engine.api.options import KernelOptions, Limits, PrecisionConfig, SpeculationConfig
from engine.api.profile import Profile
from engine.api.requests import Prompts, RequestChecks, is_id_list
from engine.api.runtime import make_governor
from engine.core.chat import ChatTemplate, ChatTemplateMissingError
from engine.core.errors import InvalidConfigError, InvalidRequestError, UnhealthyError
from engine.core.hub import HubOptions, resolve_ref
from engine.kernels.cpu_linear import packed_bytes
from engine.kernels.cudagraphs import graph_stats
from engine.kernels.memory import resident_weight_bytes
from engine.runtime.admission import SchedulerLimits
from engine.runtime.k_tuner import KTuner
from engine.runtime.metrics import CudaMemory, EngineGauges, Sample, engine_samples, kv_cache_usage, render_text
from engine.runtime.request import Completion, Request
from engine.runtime.scheduler import Scheduler
from engine.runtime.telemetry import gpu_stats
from engine.spec_decode.adaptive import Costs
from engine.spec_decode.costs import drafter_costs
from engine.spec_decode.loop import DecodeLoop
from engine.spec_decode.sampling import SamplingParams
from engine.spec_decode.structured.grammar import GrammarCompiler

log = logging.getLogger(__name__)

__all__ = ["Completion", "Engine", "Prompts"]


class Engine:
    """Speculative (or plain) generation with a Llama-family target.

    Build it with ``Engine.from_pretrained`` or ``Engine.from_profile``. Safe to call from any
    number of threads: requests join a continuously batched worker (engine/runtime/scheduler.py).
    """

    def __init__(
        self,
        parts: Parts,
        limits: Limits = Limits(),
        costs: Costs | None = None,
        profile: Profile | None = None,
    ) -> None:
        """An engine over assembled parts (``engine.api.assemble``); most callers use ``from_pretrained``."""
        self.target, self.tokenizer, self.drafter = parts.target, parts.tokenizer, parts.drafter
        self.draft_model, self.policy, self.vocab, self.device = (
            parts.draft_model,
            parts.policy,
            parts.vocab,
            parts.device,
        )
        self.config = parts.target.config
        self.info = dict(parts.info)
        self.profile = profile
        self.chat_template = ChatTemplate.from_dir(Path(parts.tokenizer.path).parent)  # None: the checkpoint has none
        self.limits = limits
        self.cuda_graphs = parts.graphs or None  # GraphedForward / GraphedStep wrappers (engine/kernels/)
        self._costs = costs
        ctx = self.config.max_position_embeddings
        if limits.max_seq_len is not None and limits.max_seq_len > ctx:
            raise InvalidConfigError(
                f"limits.max_seq_len={limits.max_seq_len} is invalid: allowed an int in 2..{ctx} (the model's context)"
            )
        self.max_seq_len = limits.max_seq_len if limits.max_seq_len is not None else ctx
        k_max = self.policy.k_max if self.policy is not None else 0
        eos = self.config.eos_token_ids
        self.grammars = GrammarCompiler(self.tokenizer.to_json(), self.vocab, eos)  # llguidance loads on first use
        self.requests = RequestChecks(self.tokenizer, self.vocab, ctx, self.max_seq_len, k_max, self.grammars)
        self.loop = DecodeLoop(parts.target_forward, parts.tokenizer, parts.drafter, eos, self.vocab, self.grammars)
        self.gpu_reader, governor = None, None
        if limits.load_window is not None:
            pol = self.policy
            self.gpu_reader, governor = make_governor(
                self.device, limits.load_window, pol.k_min if pol else 0, pol.k_max if pol else 0, limits.max_batch
            )
        pol = self.policy
        measured = pol is not None and pol.name == "measured"
        tuner = None
        if pol is not None and measured:
            tuner = KTuner(k_max=pol.k_max, k_start=pol.k, k_min=pol.k_min, trees=pol.trees)
        self.scheduler = Scheduler(
            self.loop,
            SchedulerLimits(limits.max_batch, limits.max_waiting, self.max_seq_len, prefill_chunk=limits.prefill_chunk),
            policy=self.policy,
            costs=lambda: self.costs,
            tuner=tuner,
            device=self.device,
            governor=governor,
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        target: str | Path,
        draft: str | Path | None = None,
        *,
        speculation: SpeculationConfig = SpeculationConfig(),
        precision: PrecisionConfig | None = None,
        limits: Limits = Limits(),
        kernels: KernelOptions = KernelOptions(),
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        hub: HubOptions = HubOptions(),
    ) -> Engine:
        """Load a target checkpoint (and a draft checkpoint or head) and build the engine; either may be a
        directory or a Hugging Face Hub id (``owner/name``, resolved through huggingface_hub as ``hub`` says).

        ``speculation``: the drafter and the K policy (without a draft checkpoint and a drafter, plain
        decoding); ``precision``: the precision plan (None: unquantized); ``limits``: batch, queue and
        length limits and the load window; ``kernels``: the kernel choices. ``device`` None: CUDA when
        present, else the CPU; ``dtype`` None: fp32 on the CPU, the checkpoint's own 16-bit dtype on CUDA.
        Each option object documents its fields (engine/api/options.py); contradictions raise
        InvalidConfigError naming both sides.
        """
        for name, v, typ in (
            ("speculation", speculation, SpeculationConfig),
            ("limits", limits, Limits),
            ("kernels", kernels, KernelOptions),
        ):
            if not isinstance(v, typ):
                raise InvalidConfigError(f"{name}={v!r:.60} is invalid: allowed a {typ.__name__}")
        if precision is not None and not isinstance(precision, PrecisionConfig):
            raise InvalidConfigError(f"precision={precision!r:.60} is invalid: allowed a PrecisionConfig or None")
        if not isinstance(hub, HubOptions):
            raise InvalidConfigError(f"hub={hub!r:.60} is invalid: allowed a HubOptions")
        target = resolve_ref(target, hub)
        draft = None if draft is None else resolve_ref(draft, hub, draft=True)
        dev = resolve_device(device)
        parts = build_off_thread(lambda: assemble(target, draft, speculation, precision, kernels, dev, dtype), dev)
        return cls(parts, limits, speculation.costs, None)

    @classmethod
    def from_profile(
        cls,
        path: str | Path,
        device: str | torch.device | None = None,
        *,
        limits: Limits | None = None,
        full_check: bool = False,
        plain: bool = False,
    ) -> Engine:
        """Build exactly the engine a profile describes (tools/build_profile.py writes them).

        ``limits``: batch and queue limits (the profile's load window is kept); ``plain``: the profile's target
        on its plan without the drafter (the baseline speculation is measured against). Refuses with a
        ProfileError naming the file and the field: a missing file, invalid JSON, an unknown schema
        version, missing fields, weights whose sha256 changed; and with KernelUnavailableError a
        kernel this machine lacks. Weight hashes are checked against a verified (size, mtime, inode, sha256)
        record beside the weights (engine/core/files.py), re-hashing only files that changed; ``full_check``
        re-hashes all.
        """
        from engine.api.profile import load_profile

        return cls.for_profile(load_profile(path, full_check=full_check), device, limits=limits, plain=plain)

    @classmethod
    def for_profile(
        cls,
        prof: Profile,
        device: str | torch.device | None = None,
        *,
        limits: Limits | None = None,
        plain: bool = False,
    ) -> Engine:
        """The engine a profile already loaded (``engine.api.profile.load_profile``) describes (``plain``: its
        target on its plan, no drafter)."""
        from engine.api.profile import engine_options

        o = engine_options(prof, device, limits or Limits())
        spec: SpeculationConfig = SpeculationConfig() if plain else o["speculation"]
        draft = None if plain else o["draft"]
        parts = build_off_thread(
            lambda: assemble(o["target"], draft, spec, o["precision"], o["kernels"], o["device"], None), o["device"]
        )
        return cls(parts, o["limits"], spec.costs, prof)

    # ------------------------------------------------------------------ costs
    @property
    def costs(self) -> Costs | None:
        """The cost ratios of the K controller (measured on first use when not given)."""
        if self._costs is None and self.drafter is not None:
            assert self.policy is not None
            self._costs = drafter_costs(self.target, self.drafter, self.policy.k_max)
            log.info("measured costs: c=%.3f v=%s", self._costs.c, self._costs.v)
        return self._costs

    # ------------------------------------------------------------------ requests
    # ------------------------------------------------------------------ public API
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Request:
        """Queue one prompt; the handle has ``result()``, ``cancel()``, ``done()`` and iterates text pieces.

        Raises InvalidRequestError for a bad request, OverloadedError when the wait queue is full.
        """
        ids, plist = self.requests.check([prompt] if not is_id_list(prompt) else [list(prompt)], params)
        return self.scheduler.submit(ids, plist)[0]

    def submit_many(self, prompts: Sequence[str | Sequence[int]], params: Sequence[SamplingParams]) -> list[Request]:
        """Queue several prompts together (all or none: OverloadedError when they do not all fit)."""
        ids, plist = self.requests.check([p if isinstance(p, str) else list(p) for p in prompts], list(params))
        return self.scheduler.submit(ids, plist)

    def encode_prompt(self, text: str) -> list[int]:
        """A plain prompt's token ids (with the tokenizer's special tokens, e.g. BOS)."""
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"prompt={text!r:.80} is invalid: allowed a non-empty string")
        return self.tokenizer.encode(text)

    def chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of ``messages`` rendered by the checkpoint's chat template (encoded without adding
        special tokens: the template writes them)."""
        if self.chat_template is None:
            raise ChatTemplateMissingError(
                f"the model {self.info.get('target_dir')} has no chat template (no chat_template in "
                "tokenizer_config.json, no chat_template.jinja): chat is unavailable, plain completions work"
            )
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidRequestError("messages render to an empty prompt: a prompt needs >= 1 token")
        return ids

    def chat(self, messages: Sequence[dict[str, Any]], params: SamplingParams | None = None) -> Completion:
        """Answer a conversation ([{"role", "content"}, ...]) with the checkpoint's chat template."""
        return self.generate([self.chat_prompt(messages)], params)[0]

    def generate(
        self, prompts: Prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Complete every prompt; params: one SamplingParams for all, or one per prompt.

        finish_reason is "stop", "length", or "error" (NaN/inf logits in that sequence);
        a failed round raises RequestFailedError (an EngineError).
        """
        ids, plist = self.requests.check(prompts, params)
        reqs = self.scheduler.submit(ids, plist, drive=True)
        try:
            self.scheduler.drive(reqs)  # rounds run in this thread (see Scheduler.drive)
            return [r.result() for r in reqs]
        finally:
            for r in reqs:
                if not r.done():
                    r.cancel()

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one prompt's completion as tokens are accepted (never splitting a character).

        Closing the iterator early cancels the request and frees its slot within one round.
        """
        req = self.submit(prompt, params)
        yield from req.text_pieces()

    def metric_samples(self) -> list[Sample]:
        """Every counter and gauge, from one snapshot of the scheduler's totals (engine/runtime/metrics.py):
        what ``metrics_text()``, the server's /metrics and the Ray replica metrics publish."""
        cache = self.loop.cache
        gauges = EngineGauges(
            kv_cache_bytes=cache.nbytes if cache is not None else 0,
            kv_cache_usage=kv_cache_usage(cache, self.scheduler.running_requests()),
            cuda_memory=CudaMemory.read(self.device),
            governor=self.scheduler.governor,
            graphs=graph_stats(self.cuda_graphs),
            tuned=None if self.scheduler.tuner is None else self.scheduler.tuner.best(),
            draft_cost=_draft_cost(self),
        )
        return engine_samples(self.scheduler.snapshot(), gauges)

    def metrics_text(self) -> str:
        """Counters and gauges in the Prometheus text exposition format (``metric_samples()`` rendered)."""
        return render_text(self.metric_samples())

    @torch.no_grad()
    def logits(self, token_ids: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """Target logits [B, T, V] (as planned, fp32) for equal-length token lists, no cache."""
        if isinstance(token_ids, torch.Tensor):
            ids = self.requests.token_tensor(token_ids)
        else:
            rows = (
                self.requests.prompt_ids([list(r) for r in token_ids])
                if isinstance(token_ids, (list, tuple))
                else self.requests.prompt_ids(token_ids)
            )
            if len({len(r) for r in rows}) != 1:
                raise InvalidRequestError("token_ids rows have different lengths: allowed equal-length rows")
            ids = self.requests.token_tensor(torch.tensor(rows, dtype=torch.long))
        return self.target(ids.to(self.device)).float()

    def check_health(self, stall_s: float = 120.0, max_failed_rounds: int = 3) -> None:
        """Raise UnhealthyError when the engine cannot make progress: a decode round running longer than
        ``stall_s`` seconds (a hung device), ``max_failed_rounds`` failed rounds in a row, or pending
        requests that no worker runs. Cheap (no device work): health probes call it every few seconds."""
        problem = self.scheduler.health(stall_s, max_failed_rounds)
        if problem is not None:
            raise UnhealthyError(f"engine unhealthy: {problem}")

    def reset_stats(self) -> None:
        """Start the engine-wide counters of ``stats()`` afresh."""
        self.scheduler.reset_totals()

    def stats(self) -> dict[str, Any]:
        """Acceptance rate, mean accepted length, tokens/s, target passes per token, memory."""
        snap = self.scheduler.snapshot()
        t = snap["totals"]
        mem = {
            "kv_cache_bytes": self.loop.cache.nbytes if self.loop.cache is not None else 0,
            "target_weight_bytes": resident_weight_bytes(self.target),
            "cpu_packed_bytes": packed_bytes(self.target),
        }  # weights as allocated, the kernels' copies included (the packed ones also apart)
        if self.draft_model is not None:
            mem["draft_weight_bytes"] = resident_weight_bytes(self.draft_model)
        if self.device.type == "cuda":
            mem["cuda_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            mem["cuda_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
        return {
            **t.summary(),
            "waiting": snap["waiting"],
            "running": snap["running"],
            "errors": t.nonfinite + t.failed,
            "drafter": self.info.get("drafter"),
            "prompt_lookup_min": self.info.get("prompt_lookup_min"),
            "k_policy": self.policy.name if self.policy else None,
            "memory": mem,
            **_runtime_stats(self),
        }


def _runtime_stats(engine: Engine) -> dict[str, Any]:
    """CUDA graph counters and capture time, GPU memory/utilization, the load window and the K tuner's figures (None
    when off)."""
    gov = engine.scheduler.governor
    return {
        "cuda_graphs": graph_stats(engine.cuda_graphs),
        "gpu": gpu_stats(engine.device, engine.gpu_reader),
        "load_window": None if gov is None else gov.snapshot(),
        "k_tuner": None if engine.scheduler.tuner is None else engine.scheduler.tuner.snapshot(),
        "draft_cost": _draft_cost(engine),
    }


def _draft_cost(engine: Engine) -> dict[str, dict[str, float | None]] | None:
    """The draft cost per batch bucket (engine/runtime/draft_cost.py), kept with the tuner (None without)."""
    return None if engine.scheduler.tuner is None else engine.scheduler.draft_cost.snapshot()
