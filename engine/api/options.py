"""The Engine's configuration: validated, frozen dataclasses, one per concern.

``Engine.from_pretrained(target, draft, *, speculation, precision, limits, kernels, device, dtype)``
takes these. Each field is checked when the object is made; a contradiction between two fields
(or with the models given) is an ``InvalidConfigError`` naming both, never a silent override.
A profile's ``speculation`` and ``runtime`` sections serialise ``SpeculationConfig``,
``KernelOptions`` and ``Limits.load_window`` (``to_profile`` / ``from_profile``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.core.errors import InvalidConfigError
from engine.kernels.backends import ATTENTION_CHOICES
from engine.kernels.cudagraphs import DEFAULT_BATCH_BUCKETS, check_buckets
from engine.runtime.telemetry import DEFAULT_RESUME, DEFAULT_THRESHOLD, LoadWindow
from engine.spec_decode.adaptive import POLICIES, Costs
from engine.spec_decode.registry import DRAFTERS, DrafterEntry, DrafterRegistry
from quant.plan_schema import PrecisionPlan

STEP_WEIGHTS = ("float16", "bfloat16", "float32")


def _int(name: str, v: Any, lo: int, hi: int | None = None) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise InvalidConfigError(f"{name}={v!r} is invalid: allowed an int {rng}")


@dataclass(frozen=True)
class SpeculationConfig:
    """What drafts and how many tokens it drafts per round."""

    drafter: str | None = None
    """A name of ``registry`` (engine/spec_decode/registry.py): "model" (a draft checkpoint), "ngram" (prompt
    lookup), "early-exit" (the target's first layers), "medusa" / "eagle" (a head directory written by
    specmix-train-draft as the draft), or None: "model" when a draft checkpoint is given, else plain decoding."""
    k: int = 5
    """Draft tokens per round at the start (the fixed K of the "constant" policy)."""
    k_policy: str = "measured"
    """How K moves: "measured" (each round's K from measured round times per batch bucket and the rows' running
    acceptance, plain rounds included; engine/runtime/k_tuner.py), "cost-model" (per sequence, maximise the
    expected speedup from the running acceptance and the costs measured with bare forward passes), "heuristic"
    (+2 after a full acceptance, -1 otherwise) or "constant"."""
    k_min: int = 1
    """Smallest K the policy may choose (<= k)."""
    k_max: int | None = None
    """Largest K the policy may choose (>= k); None: max(8, k)."""
    early_exit_layers: int | None = None
    """Layers of the target the "early-exit" drafter runs (1..layers-1); None: a quarter of them.
    Only with drafter="early-exit"."""
    costs: Costs | None = None
    """Cost ratios of the draft step and the verify pass to a target step (``Costs``); None: measured
    on first use (the "cost-model" policy needs them; a profile's calibration keeps them)."""
    prompt_lookup_min: int | None = None
    """Prompt lookup first (engine/spec_decode/drafters/lookup.py): a row whose last n tokens (prompt_lookup_min
    <= n, n <= 3 or n = prompt_lookup_min) occurred earlier in its context drafts the tokens that followed them,
    the drafter the other rows; None: the drafter alone. Needs a drafter other than "ngram" (refused at load)."""
    tree_branches: int | None = None
    """Draft trees of K nodes (1..8 children per node) for the drafters that propose them: "ngram" (the
    continuations of that many earlier matches merged), "eagle" (greedy batches: the top children of the most
    probable nodes, EAGLE-2's dynamic tree), "suffix" (> 1: trees shaped by its counts); None or 1: chains.
    Verified in one masked pass."""
    suffix_global_tokens: int | None = None
    """The "suffix" drafter's global suffix tree over recent requests' outputs: its bound in tokens (0: none, each
    request drafts from its own prompt and output only); None: 2**20. Only with drafter="suffix"."""
    draft_cut: bool = True
    """With the "measured" policy: a drafter that estimates its drafts' acceptance (n-gram) cuts each greedy row's
    chain before its first draft less likely to be accepted than a draft token costs at the running batch
    (engine/runtime/draft_cost.py; a sampled row drafts its whole copy); False (drafter "ngram", policy "measured"
    only): each row drafts its whole copy, up to the round's K."""
    draft_dtype: str | None = None
    """The draft model's dtype ("float32", "float16", "bfloat16"); None: float32 on the CPU (where its
    C++ step runs), the target's dtype on CUDA. Only with a draft checkpoint."""
    registry: DrafterRegistry = DRAFTERS
    """The drafters ``drafter`` names (``DRAFTERS.extended(entry)`` adds one); not kept in profiles."""

    def __post_init__(self) -> None:
        if not isinstance(self.registry, DrafterRegistry):
            raise InvalidConfigError(
                f"speculation.registry={self.registry!r:.60} is invalid: allowed a DrafterRegistry"
            )
        if self.drafter is not None and self.drafter not in self.registry:
            raise InvalidConfigError(
                f"speculation.drafter={self.drafter!r} is invalid: allowed {', '.join(self.registry.names())} or None"
            )
        _int("speculation.k", self.k, 1)
        if self.k_policy not in POLICIES:
            raise InvalidConfigError(
                f"speculation.k_policy={self.k_policy!r} is invalid: allowed {', '.join(POLICIES)}"
            )
        _int("speculation.k_min", self.k_min, 1)
        if self.k_min > self.k:
            raise InvalidConfigError(
                f"speculation.k_min={self.k_min} is above speculation.k={self.k}: allowed k_min <= k"
            )
        if self.k_max is not None:
            _int("speculation.k_max", self.k_max, 1)
            if self.k_max < self.k:
                raise InvalidConfigError(
                    f"speculation.k_max={self.k_max} is below speculation.k={self.k}: allowed k_max >= k"
                )
        self._check_drafter_fields()
        if self.early_exit_layers is not None:
            _int("speculation.early_exit_layers", self.early_exit_layers, 1)
        if self.prompt_lookup_min is not None:
            _int("speculation.prompt_lookup_min", self.prompt_lookup_min, 1, 8)
        if self.tree_branches is not None:
            _int("speculation.tree_branches", self.tree_branches, 1, 8)
        if self.suffix_global_tokens is not None:
            _int("speculation.suffix_global_tokens", self.suffix_global_tokens, 0, 1 << 31)
        if not isinstance(self.draft_cut, bool):
            raise InvalidConfigError(f"speculation.draft_cut={self.draft_cut!r:.60} is invalid: allowed True or False")
        if not self.draft_cut and (self.drafter != "ngram" or self.k_policy != "measured"):
            raise InvalidConfigError(
                f"speculation.draft_cut=False needs drafter='ngram' and k_policy='measured' (they are "
                f"{self.drafter!r} and {self.k_policy!r}): no other drafter or policy cuts its drafts"
            )
        if self.costs is not None and not isinstance(self.costs, Costs):
            raise InvalidConfigError(f"speculation.costs={self.costs!r:.60} is invalid: allowed a Costs or None")
        if self.draft_dtype is not None and self.draft_dtype not in STEP_WEIGHTS:
            raise InvalidConfigError(
                f"speculation.draft_dtype={self.draft_dtype!r} is invalid: allowed {', '.join(STEP_WEIGHTS)} or None"
            )

    def _check_drafter_fields(self) -> None:
        """A field only one drafter reads (its registry entry's ``fields``) is refused with another drafter."""
        known = {f.name for f in dataclasses.fields(self)}
        for entry in self.registry:
            for name in entry.fields:
                if name not in known:
                    raise InvalidConfigError(
                        f"drafter {entry.name!r} reads speculation.{name}, which SpeculationConfig has no field for"
                    )
                if getattr(self, name) is not None and self.drafter != entry.name:
                    raise InvalidConfigError(
                        f"speculation.{name}={getattr(self, name)!r} needs speculation.drafter={entry.name!r} "
                        f"(it is {self.drafter!r})"
                    )

    def drafter_options(self, entry: DrafterEntry) -> dict[str, Any]:
        """The fields ``entry`` reads, by name (its factory's ``DrafterContext.options``), and ``tree_branches``
        (1: chains), which every drafter that proposes trees reads."""
        return {"tree_branches": self.tree_branches or 1, **{name: getattr(self, name) for name in entry.fields}}

    @property
    def resolved_k_max(self) -> int:
        return self.k_max if self.k_max is not None else max(8, self.k)

    def to_profile(self) -> dict[str, Any]:
        """The profile's ``speculation`` keys this object owns (the build adds its measurements)."""
        out: dict[str, Any] = {
            "drafter": self.drafter,
            "k": self.k,
            "k_min": self.k_min,
            "k_max": self.resolved_k_max,
            "policy": self.k_policy,
        }
        if self.prompt_lookup_min is not None:
            out["prompt_lookup_min"] = self.prompt_lookup_min
        if self.tree_branches is not None:
            out["tree_branches"] = self.tree_branches
        if self.suffix_global_tokens is not None:
            out["suffix_global_tokens"] = self.suffix_global_tokens
        if not self.draft_cut:
            out["draft_cut"] = False
        if self.costs is not None:
            out.update(self.costs.to_dict())
        return out

    @classmethod
    def from_profile(cls, spec: dict[str, Any]) -> SpeculationConfig:
        costs = Costs.from_dict(spec) if "c" in spec else None
        return cls(
            drafter=spec["drafter"],
            k=int(spec["k"]),
            k_min=int(spec["k_min"]),
            k_max=int(spec["k_max"]),
            k_policy=spec["policy"],
            costs=costs,
            prompt_lookup_min=spec.get("prompt_lookup_min"),
            tree_branches=spec.get("tree_branches"),
            suffix_global_tokens=spec.get("suffix_global_tokens"),
            draft_cut=spec.get("draft_cut") is not False,
        )


@dataclass(frozen=True)
class PrecisionConfig:
    """How the models are quantized (quant/plan.py decides what; the kernels are quant's)."""

    plan: PrecisionPlan
    """The precision plan (``quant.make_plan`` or a profile's ``plan`` section): per module family the
    storage dtype, kernel and scaling, for the target and the draft."""
    calibration: str | Sequence[Sequence[int]] | None = None
    """Calibration text or token lists for activation statistics (SmoothQuant); never the eval text."""

    def __post_init__(self) -> None:
        if not isinstance(self.plan, PrecisionPlan):
            raise InvalidConfigError(f"precision.plan={self.plan!r:.60} is invalid: allowed a PrecisionPlan")
        if self.calibration is not None and not isinstance(self.calibration, (str, list, tuple)):
            raise InvalidConfigError(
                f"precision.calibration={self.calibration!r:.60} is invalid: allowed a str, token-id lists or None"
            )

    def target_only(self) -> PrecisionConfig:
        """The same plan for the target alone (its draft section dropped), with the same calibration."""
        return dataclasses.replace(self, plan=dataclasses.replace(self.plan, draft=None))


@dataclass(frozen=True)
class LoadWindowConfig:
    """The load window: above this share of device memory in use, K and the admitted batch step down."""

    memory_threshold: float = DEFAULT_THRESHOLD
    """Device memory in use (0..1) above which the window narrows."""
    resume_below: float = DEFAULT_RESUME
    """Device memory in use (0..1) below which it widens again (< memory_threshold)."""
    reader: Any = None
    """What reads device memory (engine/runtime/telemetry.py's Reader); None: NVML, else cudaMemGetInfo,
    on CUDA, and nothing on the CPU. Tests pass their own."""

    def __post_init__(self) -> None:
        try:
            LoadWindow(1, 1, threshold=self.memory_threshold, resume=self.resume_below)
        except InvalidConfigError as e:
            raise InvalidConfigError(f"limits.load_window: {e}") from None


@dataclass(frozen=True)
class Limits:
    """How much the engine takes on at once."""

    max_batch: int = 64
    """Sequences decoded at once (rows of the KV cache)."""
    max_waiting: int = 4096
    """Requests queued beyond the running batch; more get OverloadedError."""
    max_seq_len: int | None = None
    """Longest request (prompt + max_new_tokens); None: the model's context."""
    load_window: LoadWindowConfig | None = None
    """Lower K and the batch under GPU memory pressure (CUDA only; a no-op on the CPU); None: off."""
    prefill_chunk: int | None = 256
    """Prompt tokens prefilled while other requests decode, per token each decoding row is given in a round (a
    decayed mean: one in plain rounds, more where drafts are accepted), so that a joining prompt stalls the
    running streams, on average over recent rounds, for at most that many tokens' forward per token they
    receive (chunked prefill; a prefill begun first, then the prompts in the order they came); None: a prompt
    prefills whole."""

    def __post_init__(self) -> None:
        _int("limits.max_batch", self.max_batch, 1, 1 << 16)
        if self.prefill_chunk is not None:
            _int("limits.prefill_chunk", self.prefill_chunk, 1, 1 << 20)
        _int("limits.max_waiting", self.max_waiting, 0, 1 << 30)
        if self.max_seq_len is not None:
            _int("limits.max_seq_len", self.max_seq_len, 2)
        if self.load_window is not None and not isinstance(self.load_window, LoadWindowConfig):
            raise InvalidConfigError(
                f"limits.load_window={self.load_window!r:.60} is invalid: allowed a LoadWindowConfig or None"
            )


@dataclass(frozen=True)
class KernelOptions:
    """Which kernels run the models (engine/kernels/backends.py chooses; nothing falls back silently)."""

    attention: str | None = None
    """The target's attention backend ("sdpa", "math", "flash-attn-2", "auto"); None: "math" beside packed bf16
    linears on the CPU, else "sdpa". Not with a precision plan (the plan names it)."""
    cpu_pack: bool | None = None
    """The CPU's C++ kernels (few-row GEMM, the one-call decode step, oneDNN-packed bf16): None uses
    them where they run, True requires them, False keeps PyTorch's. Only on the CPU."""
    draft_step_weights: str | None = None
    """How the draft's C++ step, or a trained head's, stores its GEMM weights ("float16", "bfloat16",
    "float32"); None: bfloat16 where lossless, else float16. Only on the CPU."""
    cuda_graphs: bool = False
    """Capture the draft and verify steps as CUDA graphs (CUDA only)."""
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    """Batch sizes a graph is captured for (a batch runs in the next bucket up)."""
    emulate_graphs: bool = False
    """Run the graph wrappers' bookkeeping eagerly (tests of the graph path on the CPU)."""

    def __post_init__(self) -> None:
        if self.attention is not None and self.attention not in ATTENTION_CHOICES:
            raise InvalidConfigError(
                f"kernels.attention={self.attention!r} is invalid: allowed {', '.join(ATTENTION_CHOICES)} or None"
            )
        if self.cpu_pack not in (None, True, False):
            raise InvalidConfigError(
                f"kernels.cpu_pack={self.cpu_pack!r} is invalid: allowed None (where it runs), True, False"
            )
        if self.draft_step_weights is not None and self.draft_step_weights not in STEP_WEIGHTS:
            raise InvalidConfigError(
                f"kernels.draft_step_weights={self.draft_step_weights!r} is invalid: allowed "
                f"{', '.join(STEP_WEIGHTS)} or None (bfloat16 where lossless, else float16)"
            )
        object.__setattr__(self, "batch_buckets", check_buckets(self.batch_buckets, "kernels.batch_buckets"))
        if self.emulate_graphs and not self.cuda_graphs:
            raise InvalidConfigError("kernels.emulate_graphs=True needs kernels.cuda_graphs=True")
