"""The public Engine: load a target (and a drafter), generate, stream, score."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from engine.api.plan_apply import apply_precision_plan
from engine.core.chat import ChatTemplate, ChatTemplateMissingError
from engine.core.checkpoint import load_model, resolve_dtype
from engine.core.errors import (
    InvalidConfigError,
    InvalidRequestError,
    VocabMismatchError,
)
from engine.core.model import Transformer, fuse_projections
from engine.core.tokenizer import Tokenizer
from engine.kernels.backends import ATTENTION_CHOICES, select_attention
from engine.kernels.cpu_decode import install_decode_step, step_info
from engine.kernels.cpu_linear import fast_cpu_linears, packed_bytes
from engine.serve.metrics import metrics_text
from engine.serve.scheduler import Request, Scheduler
from engine.spec.adaptive import Costs, KPolicy
from engine.spec.costs import measure_costs
from engine.spec.drafters import (
    DRAFTERS,
    Drafter,
    EarlyExitDrafter,
    ModelDrafter,
    NGramDrafter,
)
from engine.spec.loop import DecodeLoop, Seq, TokenLogprob
from engine.spec.sampling import SamplingParams

log = logging.getLogger(__name__)

Prompts = str | Sequence[str] | Sequence[Sequence[int]]


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos or a stop string), "length", "error"
    prompt_token_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # with SamplingParams.logprobs: one per token of token_ids


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidConfigError(f"device={device!r} is invalid: allowed 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidConfigError(f"device={device!r} is invalid: allowed 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidConfigError(f"device={device!r} is not available here: no CUDA device; use 'cpu'")
    return dev


class Engine:
    """Speculative (or plain) generation with a Llama-family target.

    Build it with ``Engine.from_pretrained`` or ``Engine.from_profile``. Safe to call from any
    number of threads: requests join a continuously batched worker (engine/scheduler.py).
    Options: ``max_batch`` sequences decoded at once (cache rows), ``max_waiting`` requests
    queued beyond them (more -> OverloadedError), ``max_seq_len`` the longest request
    (prompt + max_new_tokens; default the model's context).
    """

    def __init__(self, target: Transformer, tokenizer: Tokenizer, *, drafter: Drafter | None = None,
                 draft_model: Transformer | None = None, policy: KPolicy | None = None,
                 costs: Costs | None = None, vocab: int | None = None, device: torch.device | None = None,
                 info: dict[str, Any] | None = None, max_batch: int = 64, max_waiting: int = 4096,
                 max_seq_len: int | None = None) -> None:
        self.target, self.tokenizer, self.drafter, self.draft_model = target, tokenizer, drafter, draft_model
        self.config = target.config
        self.device = device or target.norm.weight.device
        self.policy = policy if drafter is not None else None
        self._costs = costs
        self.vocab = vocab or target.config.vocab_size
        self.info = dict(info or {})
        self.loop = DecodeLoop(target, tokenizer, drafter, target.config.eos_token_ids, self.vocab, self.device)
        self.profile: dict[str, Any] | None = None
        ctx = self.config.max_position_embeddings
        for name, v, lo, hi in (("max_batch", max_batch, 1, 1 << 16), ("max_waiting", max_waiting, 0, 1 << 30),
                                ("max_seq_len", ctx if max_seq_len is None else max_seq_len, 2, ctx)):
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise InvalidConfigError(f"{name}={v!r} is invalid: allowed an int in {lo}..{hi}")
        self.max_seq_len = ctx if max_seq_len is None else max_seq_len
        self.scheduler = Scheduler(self, max_batch, max_waiting, self.max_seq_len)
        self.chat_template = ChatTemplate.from_dir(Path(tokenizer.path).parent)  # None: the checkpoint has none
        self.cuda_graphs: list[Any] | None = None  # GraphedForward wrappers when graphs are on (cudagraphs.py)
        self.gpu_reader: Any = None  # NVML / cudaMemGetInfo reader (telemetry.py); None on the CPU

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, target_dir: str | Path, draft_dir: str | Path | None = None, *,
                        drafter: str | None = "model", k: int = 5, adaptive_k: bool = True,
                        device: str | torch.device | None = "cpu", plan: Any = None,
                        dtype: str | torch.dtype | None = None, k_policy: str | None = None,
                        k_min: int = 1, k_max: int | None = None, early_exit_layers: int | None = None,
                        costs: Costs | dict | None = None,
                        calib: str | Sequence[Sequence[int]] | None = None, max_batch: int = 64,
                        max_waiting: int = 4096, max_seq_len: int | None = None,
                        cpu_pack: bool | None = None, draft_dtype: str | torch.dtype | None = None,
                        attention: str | None = None, draft_step_weights: str | None = None) -> "Engine":
        """Load a target (and a drafter). drafter: "model" (needs draft_dir), "ngram", "early-exit" or None.

        With drafter="model" and no draft_dir the engine decodes plainly. ``plan`` (a PrecisionPlan)
        quantizes both models by module swap; None keeps them unquantized. ``calib`` (text or
        token lists, never the eval text) feeds SmoothQuant when the plan asks for it.
        ``dtype``: the models' dtype (default float32 on the CPU, float16 on CUDA). ``draft_dtype``: the draft
        model's (default: float32 on the CPU, where its C++ step runs; ``dtype`` on CUDA). ``cpu_pack``: the
        CPU's fast kernels (engine/cpu_linear.py): bf16 linears on oneDNN-packed weights, fp32 ones on the
        small-GEMM kernel, and each fp32 model's cached forward as one C++ call (engine/cpu_decode.py; AMX
        tiles for bf16-valued weights); None uses them where they run, True requires them, False keeps PyTorch's.
        ``draft_step_weights``: how that step stores the draft's GEMM weights: "float16", "bfloat16" (half
        the bytes; the target verifies every proposal, so only the acceptance can move) or "float32"; None:
        bfloat16 where lossless, else float16. The target's are 16-bit only where lossless (a bf16 checkpoint).
        ``attention``: the target's attention backend (engine/backends.py: "sdpa", "math", ...). None picks
        "math" with packed bf16 linears (then a verify row equals the one-token step bit for bit, so greedy
        speculation reproduces the bf16 target exactly; it costs ~4% of speculative and ~17% of plain
        decode speed on the demo pair) and "sdpa" otherwise. With a plan it must be None (the plan names it).
        """
        if draft_step_weights not in (None, "float16", "bfloat16", "float32"):
            raise InvalidConfigError(f"draft_step_weights={draft_step_weights!r} is invalid: allowed 'float16', "
                                     "'bfloat16', 'float32' or None (bfloat16 where lossless, else float16)")
        if drafter is not None and drafter not in DRAFTERS:
            raise InvalidConfigError(f"drafter={drafter!r} is invalid: allowed {', '.join(DRAFTERS)} or None")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidConfigError(f"k={k!r} is invalid: allowed an int >= 1")
        if attention is not None and attention not in ATTENTION_CHOICES:
            raise InvalidConfigError(f"attention={attention!r} is invalid: allowed {', '.join(ATTENTION_CHOICES)} "
                                     "or None")
        if plan is not None and attention is not None:
            raise InvalidConfigError(f"attention={attention!r} is invalid with a plan: the plan names the backend "
                                     f"(plan.attention_backend={getattr(plan, 'attention_backend', None)!r}); "
                                     "allowed None")
        dev = _resolve_device(device)
        dt = resolve_dtype(dtype) if dtype is not None else (torch.float16 if dev.type == "cuda" else torch.float32)
        target = load_model(target_dir, dt, dev)
        tok = Tokenizer(target_dir)
        draft_model: Transformer | None = None
        vocab = target.config.vocab_size
        if drafter == "model" and draft_dir is not None:
            dtok = Tokenizer(draft_dir)
            default_ddt = torch.float32 if dev.type == "cpu" else dt
            ddt = resolve_dtype(draft_dtype) if draft_dtype is not None else default_ddt
            draft_model = load_model(draft_dir, ddt, dev)
            if dtok.vocab() != tok.vocab():
                raise VocabMismatchError(
                    f"draft {draft_dir} and target {target_dir} have different vocabularies: "
                    f"draft tokenizer has {dtok.vocab_size} tokens (model vocab {draft_model.config.vocab_size}), "
                    f"target has {tok.vocab_size} (model vocab {target.config.vocab_size})")
            vocab = min(vocab, draft_model.config.vocab_size)
        if plan is not None:
            apply_precision_plan(plan, target, draft_model, tok, dev, calib)
        # q/k/v and gate/up as one GEMM each where they are plain Linears (after the plan's swaps)
        fused = fuse_projections(target) + (fuse_projections(draft_model) if draft_model is not None else 0)
        # then the CPU linears on the fast kernel for the weights' dtype after any plan (a CPU plan computes in fp32)
        packed, cpu_kernel = fast_cpu_linears(target, dev, cpu_pack)
        if plan is None:
            target.attn_fn = select_attention(attention or ("math" if cpu_kernel == "onednn-bf16" else "sdpa"), dev)
        # each fp32 model's few-row forward as one C++ call (engine/cpu_decode.py; the draft stays fp32 on the
        # CPU beside a bf16 target too); GEMM weights 16-bit where lossless ("auto": else fp16, for the draft)
        step_w = {"target": None, "draft": resolve_dtype(draft_step_weights) if draft_step_weights else "auto"}
        stepped = [name for name, m in (("target", target), ("draft", draft_model))  # (a reason is logged)
                   if dev.type == "cpu" and cpu_pack is not False and m is not None
                   and install_decode_step(m, step_w[name]) is None]
        d: Drafter | None = None
        if drafter == "model" and draft_model is not None:
            d = ModelDrafter(draft_model, None)
        elif drafter == "ngram":
            d = NGramDrafter()
        elif drafter == "early-exit":
            n = target.config.num_hidden_layers
            L = early_exit_layers if early_exit_layers is not None else max(1, n // 4)
            if not isinstance(L, int) or not 1 <= L < n:
                raise InvalidConfigError(f"early_exit_layers={L!r} is invalid: allowed 1..{n - 1}")
            d = EarlyExitDrafter(target, L)
        k_max = k_max if k_max is not None else max(8, k)
        name = k_policy or ("cost-model" if adaptive_k else "constant")
        policy = KPolicy(name=name, k=k, k_min=min(k_min, k), k_max=k_max) if d is not None else None
        if isinstance(costs, dict):
            costs = Costs.from_dict(costs)
        info = {"target_dir": str(target_dir), "draft_dir": None if draft_dir is None else str(draft_dir),
                "drafter": drafter if d is not None else None, "dtype": str(dt).replace("torch.", ""),
                "draft_dtype": None if draft_model is None else str(draft_model.dtype).replace("torch.", ""),
                "fused_projection_groups": fused, "cpu_packed_linears": packed, "cpu_linear_kernel": cpu_kernel,
                "cpu_decode_step": stepped, **step_info({"target": target, "draft": draft_model}),
                "attention": getattr(target.attn_fn, "__name__", type(target.attn_fn).__name__),
                "cpu_packed_mib": round(packed_bytes(target) / 2**20, 1)}
        return cls(target, tok, drafter=d, draft_model=draft_model, policy=policy, costs=costs,
                   vocab=vocab, device=dev, info=info, max_batch=max_batch, max_waiting=max_waiting,
                   max_seq_len=max_seq_len)

    @classmethod
    def from_profile(cls, path: str | Path, device: str | torch.device | None = None, *, max_batch: int = 64,
                     max_waiting: int = 4096, max_seq_len: int | None = None, full_check: bool = False) -> "Engine":
        """Build exactly the engine a profile describes (tools/build_profile.py writes them).

        Weight hashes are checked against a verified (size, mtime, inode, sha256) record beside the
        weights (engine/core/files.py), re-hashing only files that changed; ``full_check`` re-hashes all.

        Refuses with a ProfileError naming the file and the field: a missing file, invalid
        JSON, an unknown schema version, missing fields, weights whose sha256 changed; and
        with KernelUnavailableError a kernel this machine lacks.
        """
        from engine.api.profile import engine_kwargs, load_profile
        from engine.api.runtime import apply_runtime, runtime_settings

        prof = load_profile(path, full_check=full_check)
        kw = engine_kwargs(prof, device)
        runtime = runtime_settings(prof, kw["device"])  # missing CUDA graphs fail before any weight loads
        eng = cls.from_pretrained(**kw, max_batch=max_batch, max_waiting=max_waiting, max_seq_len=max_seq_len)
        eng.profile = prof
        apply_runtime(eng, runtime)
        return eng

    # ------------------------------------------------------------------ costs
    @property
    def costs(self) -> Costs | None:
        """The cost ratios of the K controller (measured on first use when not given)."""
        if self._costs is None and self.drafter is not None:
            assert self.policy is not None
            layers = self.drafter.n_layers if isinstance(self.drafter, EarlyExitDrafter) else None
            self._costs = measure_costs(self.target, self.draft_model, k_max=self.policy.k_max, draft_layers=layers)
            log.info("measured costs: c=%.3f v=%s", self._costs.c, self._costs.v)
        return self._costs

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, prompts: Prompts) -> list[list[int]]:
        allowed = "a str, a non-empty list of str, or a non-empty list of token-id lists"
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise InvalidRequestError(f"prompts={prompts!r:.80} is invalid: allowed {allowed}")
        out = []
        V = self.vocab
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p:
                    raise InvalidRequestError(f"prompts[{i}] is an empty string: a prompt needs >= 1 token")
                ids = self.tokenizer.encode(p)
            elif isinstance(p, (list, tuple)):
                ids = list(p)
                for j, t in enumerate(ids):
                    if not isinstance(t, int) or isinstance(t, bool):
                        raise InvalidRequestError(f"prompts[{i}][{j}]={t!r} is invalid: allowed an int token id")
                    if not 0 <= t < V:
                        raise InvalidRequestError(
                            f"prompts[{i}][{j}]={t} is out of range: allowed token ids 0..{V - 1} (vocab {V})")
            else:
                raise InvalidRequestError(f"prompts[{i}]={p!r:.80} is invalid: allowed a str or a list of token ids")
            if not ids:
                raise InvalidRequestError(f"prompts[{i}] is empty: a prompt needs >= 1 token")
            out.append(ids)
        return out

    def _params(self, params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params):
            if len(params) != n:
                raise InvalidRequestError(
                    f"params has {len(params)} entries for {n} prompts: allowed one SamplingParams or one per prompt")
            return list(params)
        raise InvalidRequestError(f"params={params!r:.80} is invalid: allowed a SamplingParams or a list of them")

    def _validate(self, prompts: Prompts, params: Any) -> tuple[list[list[int]], list[SamplingParams]]:
        """Prompt ids and per-prompt params, refusing what cannot fit the context or the cache."""
        ids = self._prompt_ids(prompts)
        plist = self._params(params, len(ids))
        ctx, lim = self.config.max_position_embeddings, self.max_seq_len
        for i, (p, sp) in enumerate(zip(ids, plist)):
            n = len(p) + sp.max_new_tokens
            if n > ctx:  # drafts never pass prompt + max_new_tokens - 1: K is capped by what remains
                raise InvalidRequestError(
                    f"prompts[{i}] has {len(p)} tokens + max_new_tokens {sp.max_new_tokens} = "
                    f"{n}, beyond the model's context of {ctx} tokens")
            if n > lim:
                k = self.scheduler.k_max
                raise InvalidRequestError(
                    f"prompts[{i}] has {len(p)} tokens + max_new_tokens {sp.max_new_tokens} = {n}, beyond the "
                    f"engine's max_seq_len={lim} (the KV cache holds max_seq_len + k_max {k} + 2 positions per row)")
        return ids, plist

    def _completion(self, s: Seq) -> Completion:
        return Completion(text=self.loop.final_text(s), token_ids=s.generated,
                          finish_reason=s.finish_reason or "length", prompt_token_ids=s.prompt,
                          stats=s.stats.to_dict(), logprobs=None if s.logprobs is None else list(s.logprobs))

    # ------------------------------------------------------------------ public API
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Request:
        """Queue one prompt; the handle has ``result()``, ``cancel()``, ``done()`` and iterates text pieces.

        Raises InvalidRequestError for a bad request, OverloadedError when the wait queue is full.
        """
        ids, plist = self._validate([prompt] if not _is_id_list(prompt) else [list(prompt)], params)
        return self.scheduler.submit(ids, plist)[0]

    def submit_many(self, prompts: Sequence[str | Sequence[int]],
                    params: Sequence[SamplingParams]) -> list[Request]:
        """Queue several prompts together (all or none: OverloadedError when they do not all fit)."""
        ids, plist = self._validate([p if isinstance(p, str) else list(p) for p in prompts], list(params))
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
                "tokenizer_config.json, no chat_template.jinja): chat is unavailable, plain completions work")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidRequestError("messages render to an empty prompt: a prompt needs >= 1 token")
        return ids

    def chat(self, messages: Sequence[dict[str, Any]], params: SamplingParams | None = None) -> Completion:
        """Answer a conversation ([{"role", "content"}, ...]) with the checkpoint's chat template."""
        return self.generate([self.chat_prompt(messages)], params)[0]

    def generate(self, prompts: Prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Complete every prompt; params: one SamplingParams for all, or one per prompt.

        finish_reason is "stop", "length", or "error" (NaN/inf logits in that sequence);
        a failed round raises RequestFailedError (an EngineError).
        """
        ids, plist = self._validate(prompts, params)
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

    def metrics_text(self) -> str:
        """Counters and gauges in the Prometheus text exposition format."""
        return metrics_text(self)

    @torch.no_grad()
    def logits(self, token_ids: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """Target logits [B, T, V] (as planned, fp32) for equal-length token lists, no cache."""
        if isinstance(token_ids, torch.Tensor):
            ids = token_ids
        else:
            rows = self._prompt_ids([list(r) for r in token_ids]) if isinstance(token_ids, (list, tuple)) else \
                self._prompt_ids(token_ids)
            if len({len(r) for r in rows}) != 1:
                raise InvalidRequestError("token_ids rows have different lengths: allowed equal-length rows")
            ids = torch.tensor(rows, dtype=torch.long)
        if ids.dim() != 2:
            raise InvalidRequestError(f"token_ids has shape {tuple(ids.shape)}: allowed [B, T]")
        if ids.shape[1] > self.config.max_position_embeddings:
            raise InvalidRequestError(
                f"token_ids has {ids.shape[1]} tokens, beyond the context of {self.config.max_position_embeddings}")
        return self.target(ids.to(self.device)).float()

    def reset_stats(self) -> None:
        """Start the engine-wide counters of ``stats()`` afresh."""
        self.scheduler.reset_totals()

    def stats(self) -> dict[str, Any]:
        """Acceptance rate, mean accepted length, tokens/s, target passes per token, memory."""
        snap = self.scheduler.snapshot()
        t = snap["totals"]
        mem = {"kv_cache_bytes": self.loop.cache.nbytes if self.loop.cache is not None else 0,
               "target_weight_bytes": _module_bytes(self.target),
               "cpu_packed_bytes": packed_bytes(self.target)}  # packed copies (cpu_pack), not in the above
        if self.draft_model is not None:
            mem["draft_weight_bytes"] = _module_bytes(self.draft_model)
        if self.device.type == "cuda":
            mem["cuda_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            mem["cuda_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
        return {
            "requests": t.requests,
            "generated_tokens": t.generated,
            "drafted": t.drafted,
            "accepted": t.accepted,
            "acceptance_rate": t.accepted / t.drafted if t.drafted else None,
            "token_acceptance": sum(t.pos_accepted) / sum(t.pos_tried) if sum(t.pos_tried) else None,
            "mean_accepted_length": 1 + t.accepted / t.iterations if t.iterations else None,
            "tokens_per_s": t.generated / t.seconds if t.seconds else None,
            "target_passes_per_token": t.iterations / t.generated if t.generated else None,
            "target_forwards": t.target_forwards,
            "waiting": snap["waiting"],
            "running": snap["running"],
            "errors": t.nonfinite + t.failed,
            "drafter": self.info.get("drafter"),
            "k_policy": self.policy.name if self.policy else None,
            "memory": mem,
            **_runtime_stats(self),
        }


def _runtime_stats(engine: Engine) -> dict[str, Any]:
    """CUDA graph counters and capture time, GPU memory/utilization and the load window (None when off)."""
    from engine.kernels.cudagraphs import graph_stats
    from engine.serve.telemetry import gpu_stats

    gov = engine.scheduler.governor
    return {"cuda_graphs": graph_stats(engine.cuda_graphs), "gpu": gpu_stats(engine.device, engine.gpu_reader),
            "load_window": None if gov is None else gov.snapshot()}


def _module_bytes(m: torch.nn.Module) -> int:
    """Parameters and buffers (quantized weights, scales), without cpu_linear's packed copies."""
    seen, n = set(), 0
    bufs = [b for name, b in m.named_buffers() if name.rsplit(".", 1)[-1] != "packed"]
    for t in list(m.parameters()) + bufs:
        if id(t) not in seen:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    return n


def _is_id_list(p: object) -> bool:
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(t, int) for t in p)
