"""A profile's sections about its models and speculation: the models and their weight hashes, the memory
figures, the calibration text and what the speculation calibration measured. Each reads and writes itself
(``from_dict`` / ``to_dict``); engine/api/profile.py holds the whole profile."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.api.options import SpeculationConfig
from engine.api.profile_fields import JsonFields, is_number
from engine.core.errors import InvalidConfigError, ProfileError

SPECULATION_REQUIRED = ("drafter", "k", "k_min", "k_max", "policy")


@dataclass(frozen=True)
class ModelRecord:
    """One model of a profile (``models.target``, ``models.draft``)."""

    path: str
    """A model reference (``model_ref``): ``demo:<pair directory>/<role>`` for a demo model, else its path."""
    sha256: dict[str, str]
    """The sha256 of each weight file, by file name (checked at load)."""
    config: dict[str, Any]
    """The checkpoint's ModelConfig (``ModelConfig.to_dict``), or a trained head's config."""

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": dict(self.sha256), "config": copy.deepcopy(self.config)}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile", path: str = "models.target") -> ModelRecord:
        r = JsonFields(d, path, where)
        ref, sha, config = r.string("path"), r.mapping("sha256"), r.mapping("config")
        for name, digest in sha.items():
            if not isinstance(digest, str):
                raise ProfileError(f"{where}: field {path}.sha256.{name}={digest!r:.80} is invalid: allowed a string")
        return cls(ref, sha, config)


@dataclass(frozen=True)
class Models:
    """The profile's models (``models``)."""

    target: ModelRecord
    """The target model."""
    draft: ModelRecord | None = None
    """The draft model or trained head; None with the n-gram drafter (no draft)."""

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target.to_dict(), "draft": None if self.draft is None else self.draft.to_dict()}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Models:
        r = JsonFields(d, "models", where)
        target = ModelRecord.from_dict(r.raw("target"), where, "models.target")
        draft = None if r.absent("draft") else ModelRecord.from_dict(r.d["draft"], where, "models.draft")
        return cls(target, draft)


@dataclass(frozen=True)
class WeightBytes:
    """One model's weights in memory (``memory.target``, ``memory.draft``)."""

    bytes: int
    """Bytes of its weights as planned."""
    fp16_bytes: int
    """Bytes of its weights in FP16."""

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "fp16_bytes": self.fp16_bytes}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile", path: str = "memory.target") -> WeightBytes:
        r = JsonFields(d, path, where)
        return cls(r.integer("bytes"), r.integer("fp16_bytes"))


@dataclass(frozen=True)
class Memory:
    """The plan's memory figures (``memory``)."""

    target: WeightBytes
    """The target's weights."""
    draft: WeightBytes | None
    """The draft's weights; None without a draft."""
    kv_cache_bytes: int
    """Bytes of the KV cache for max_batch x max_seq_len."""
    budget_bytes: int
    """The memory budget on the GPU that weights and KV cache fit."""
    max_batch: int
    """Sequences the KV cache is sized for."""
    max_seq_len: int
    """Longest sequence the KV cache is sized for."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target.to_dict(),
            "draft": None if self.draft is None else self.draft.to_dict(),
            "kv_cache_bytes": self.kv_cache_bytes,
            "budget_bytes": self.budget_bytes,
            "max_batch": self.max_batch,
            "max_seq_len": self.max_seq_len,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Memory:
        r = JsonFields(d, "memory", where)
        return cls(
            target=WeightBytes.from_dict(r.raw("target"), where, "memory.target"),
            draft=None if r.absent("draft") else WeightBytes.from_dict(r.d["draft"], where, "memory.draft"),
            kv_cache_bytes=r.integer("kv_cache_bytes"),
            budget_bytes=r.integer("budget_bytes"),
            max_batch=r.integer("max_batch"),
            max_seq_len=r.integer("max_seq_len"),
        )


@dataclass(frozen=True)
class CalibrationText:
    """The calibration text (``calibration``): SmoothQuant's activation statistics and the speculation probe."""

    text: str
    """A reference to it (``model_ref``: ``demo:...`` or its path); never the eval text."""
    sha256: str
    """Its sha256 (checked when the engine loads it)."""

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> CalibrationText:
        r = JsonFields(d, "calibration", where)
        return cls(r.string("text"), r.string("sha256"))


@dataclass(frozen=True)
class Probe:
    """How the calibration measured acceptance (``speculation.probe``)."""

    k: int
    """The fixed K of the probe."""
    prompts: int
    """Prompts taken from the calibration text."""
    max_new_tokens: int
    """New tokens per prompt."""
    greedy: bool
    """Greedy decoding (else sampled)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SpeculationCalibration:
    """What the calibration measured (the ``speculation`` section's figures beside its settings)."""

    acceptance: float | None = None
    """Per-token acceptance of the drafter as planned (FP8 draft); None: not measured."""
    acceptance_fp16_draft: float | None = None
    """Acceptance with the unquantized draft; None where there is none (the n-gram drafter)."""
    predicted_speedup: float | None = None
    """The cost model's speedup at the chosen K over plain decoding."""
    probe: Probe | None = None
    """How acceptance was measured."""
    per_position_acceptance: tuple[float | None, ...] | None = None
    """Acceptance per draft position (None: a position never tested); None: not measured."""

    def to_dict(self) -> dict[str, Any]:
        ppa = self.per_position_acceptance
        out: dict[str, Any] = {}
        for key, v in (
            ("acceptance", self.acceptance),
            ("acceptance_fp16_draft", self.acceptance_fp16_draft),
            ("predicted_speedup", self.predicted_speedup),
            ("probe", None if self.probe is None else self.probe.to_dict()),
            ("per_position_acceptance", None if ppa is None else list(ppa)),
        ):
            if v is not None:
                out[key] = v
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> SpeculationCalibration:
        r = JsonFields(d, "speculation", where)
        probe = None
        if not r.absent("probe"):
            p = r.obj("probe")
            probe = Probe(p.integer("k"), p.integer("prompts"), p.integer("max_new_tokens"), p.flag("greedy"))
        ppa = None
        if not r.absent("per_position_acceptance"):
            ppa = r.array("per_position_acceptance")
            if not all(x is None or is_number(x) for x in ppa):
                r.refuse("per_position_acceptance", ppa, "numbers or nulls")
            ppa = tuple(None if x is None else float(x) for x in ppa)
        return cls(
            acceptance=r.opt_number("acceptance"),
            acceptance_fp16_draft=r.opt_number("acceptance_fp16_draft"),
            predicted_speedup=r.opt_number("predicted_speedup"),
            probe=probe,
            per_position_acceptance=ppa,
        )


@dataclass(frozen=True)
class Speculation:
    """The ``speculation`` section: what the engine runs and what the calibration measured."""

    config: SpeculationConfig
    """Drafter, K, its bounds and policy, prompt lookup, and the measured costs (c, v) the K controller uses."""
    measured: SpeculationCalibration
    """Acceptance, predicted speedup and the probe."""

    def to_dict(self) -> dict[str, Any]:
        return {**self.config.to_profile(), **self.measured.to_dict()}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Speculation:
        r = JsonFields(d, "speculation", where)
        for key in SPECULATION_REQUIRED:
            r.raw(key)  # "field speculation.<key> is missing", in this order
        for key in ("drafter", "policy"):
            r.string(key)
        for key in ("k", "k_min", "k_max"):
            r.integer(key)
        r.opt_integer("prompt_lookup_min")
        r.opt_integer("tree_branches")
        r.opt_integer("suffix_global_tokens")
        r.opt_flag("draft_cut")
        if "c" in r.d:  # the measured costs (Costs.to_dict)
            r.number("c")
            v = r.opt_mapping("v") or {}
            for k, x in v.items():
                if not str(k).isdigit() or not is_number(x):
                    raise ProfileError(f"{where}: field speculation.v.{k}={x!r:.80} is invalid: allowed K -> a number")
        try:
            config = SpeculationConfig.from_profile(r.d)
        except InvalidConfigError as e:
            raise ProfileError(f"{where}: speculation: {e}") from None
        return cls(config, SpeculationCalibration.from_dict(d, where))


@dataclass(frozen=True)
class DecodeRun:
    """One engine's decoding in the build's throughput check."""

    tokens_per_s: float
    """New tokens per second, greedy, batch 1 (the median over the rounds)."""
    weight_bytes: int
    """Its target's and draft's weights resident after decoding, as allocated (the kernels' copies included)."""

    def to_dict(self) -> dict[str, Any]:
        return {"tokens_per_s": self.tokens_per_s, "weight_bytes": self.weight_bytes}

    @classmethod
    def from_dict(cls, d: Any, where: str, path: str) -> DecodeRun:
        r = JsonFields(d, path, where)
        rate, nbytes = r.number("tokens_per_s"), r.integer("weight_bytes")
        if not rate > 0:
            r.refuse("tokens_per_s", r.raw("tokens_per_s"), "a positive number")
        if nbytes < 0:
            r.refuse("weight_bytes", nbytes, "an int >= 0")
        return cls(rate, nbytes)


THROUGHPUT_RUNS = ("unquantized_plain", "planned_plain", "unquantized_speculative", "planned_speculative")


@dataclass(frozen=True)
class Throughput:
    """The ``throughput`` section: the planned models against the unquantized ones on the build's device
    (engine/build/throughput.py), each alone and with the calibrated speculation."""

    unquantized_plain: DecodeRun
    """The unquantized target decoding alone."""
    planned_plain: DecodeRun
    """The planned target decoding alone."""
    unquantized_speculative: DecodeRun
    """The unquantized target and draft with the profile's speculation."""
    planned_speculative: DecodeRun
    """The planned target and draft with the profile's speculation (what the profile runs)."""
    prompts: int
    """Calibration-text prompts decoded per round."""
    max_new_tokens: int
    """New tokens per prompt."""
    rounds: int
    """Timed rounds per engine."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name).to_dict() for name in THROUGHPUT_RUNS}
        return {**out, "prompts": self.prompts, "max_new_tokens": self.max_new_tokens, "rounds": self.rounds}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Throughput:
        r = JsonFields(d, "throughput", where)
        runs = {name: DecodeRun.from_dict(r.raw(name), where, f"throughput.{name}") for name in THROUGHPUT_RUNS}
        counts = {key: r.integer(key) for key in ("prompts", "max_new_tokens", "rounds")}
        for key, v in counts.items():
            if v < 1:
                r.refuse(key, v, "an int >= 1")
        return cls(**runs, **counts)
