"""Building an engine's parts from checkpoints and options: load, quantize, choose kernels, draft.

``assemble`` is the one place where a model's kernels are chosen (through ``Transformer.use_kernels``)
and where CUDA graphs wrap its forwards; the Engine receives the finished parts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.api.options import KernelOptions, PrecisionConfig, SpeculationConfig
from engine.api.plan_apply import apply_head_precision, apply_precision_plan
from engine.core.checkpoint import load_model, resolve_dtype
from engine.core.config import checkpoint_dtype
from engine.core.errors import InvalidConfigError, VocabMismatchError
from engine.core.forward import CachedForward
from engine.core.model import Transformer, fuse_projections
from engine.core.tokenizer import Tokenizer
from engine.kernels.backends import select_attention
from engine.kernels.cpu_decode import install_decode_step, step_info
from engine.kernels.cpu_gemm import KERNEL_NAME
from engine.kernels.cpu_linear import fast_cpu_linears, packed_bytes
from engine.kernels.cudagraphs import GraphedForward, graph_forwards
from engine.kernels.draft_kernels import DraftKernelChooser
from engine.kernels.head_graphs import GraphedStep
from engine.spec_decode.adaptive import KPolicy
from engine.spec_decode.drafter import Drafter, DrafterContext, LoadedHead
from engine.spec_decode.heads.checkpoint import load_head
from engine.spec_decode.registry import DrafterEntry, Loads, build_drafter

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """What ``assemble`` builds: the models, the drafter and what the engine reports about them."""

    target: Transformer
    tokenizer: Tokenizer
    draft_model: Transformer | None
    drafter: Drafter | None
    policy: KPolicy | None
    vocab: int
    device: torch.device
    target_forward: CachedForward  # the target, or its graphed forward
    graphs: list[GraphedForward | GraphedStep] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Models:
    """What ``parts_from_models`` builds on: the models loaded, quantized and on their kernels."""

    target: Transformer
    tokenizer: Any  # engine.core.tokenizer.Tokenizer, or what a test gives in its place
    draft_model: Transformer | None = None
    head: LoadedHead | None = None
    vocab: int | None = None  # the common vocabulary of draft and target (None: the target's)
    cpu_kernels: bool = False  # the fp32 target runs on the few-row CPU kernel (heads' C++ steps may too)
    info: dict[str, Any] = field(default_factory=dict)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None: CUDA when present, else the CPU."""
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


def resolve_model_dtype(target_dir: str | Path, dtype: str | torch.dtype | None, dev: torch.device) -> torch.dtype:
    """None: fp32 on the CPU; on CUDA the checkpoint's ``torch_dtype`` (fp16 when it names fp32 or nothing)."""
    if dtype is not None:
        return resolve_dtype(dtype)
    if dev.type == "cpu":
        return torch.float32
    own = checkpoint_dtype(target_dir)
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(own or "", torch.float16)


def drafter_entry(draft_dir: object, spec: SpeculationConfig) -> DrafterEntry | None:
    """The registry entry of the drafter to build: ``spec.drafter``, else "model" with a draft, else None."""
    name = spec.drafter if spec.drafter is not None else ("model" if draft_dir is not None else None)
    return None if name is None else spec.registry[name]


def check_options(
    draft_dir: Any,
    spec: SpeculationConfig,
    precision: PrecisionConfig | None,
    kernels: KernelOptions,
    dev: torch.device,
) -> DrafterEntry | None:
    """The drafter to build; InvalidConfigError for options that contradict each other or the models."""
    entry = drafter_entry(draft_dir, spec)
    check_draft(draft_dir, spec, entry)
    if precision is not None and kernels.attention is not None:
        raise InvalidConfigError(
            f"kernels.attention={kernels.attention!r} is invalid with a plan: precision.plan "
            f"names the backend (plan.attention_backend={precision.plan.attention_backend!r}); "
            "allowed None"
        )
    if dev.type != "cpu" and kernels.cpu_pack:
        raise InvalidConfigError(f"kernels.cpu_pack=True is for the CPU, but device={dev.type!r}")
    if dev.type != "cpu" and kernels.draft_step_weights is not None:
        raise InvalidConfigError(
            f"kernels.draft_step_weights={kernels.draft_step_weights!r} is for the CPU, but device={dev.type!r}"
        )
    if kernels.cuda_graphs and dev.type != "cuda" and not kernels.emulate_graphs:
        raise InvalidConfigError(
            f"kernels.cuda_graphs=True needs device='cuda' (device={dev.type!r}); "
            "allowed on the CPU only with kernels.emulate_graphs=True"
        )
    return entry


def check_draft(draft_dir: Any, spec: SpeculationConfig, entry: DrafterEntry | None) -> None:
    """The draft argument, the drafter and prompt lookup agree (what each drafter loads: the registry)."""
    reg, name = spec.registry, None if entry is None else entry.name
    if entry is not None and entry.loads is Loads.DRAFT_MODEL and draft_dir is None:
        others = [e.name for e in reg if e.loads is Loads.NOTHING]
        raise InvalidConfigError(
            f"speculation.drafter={name!r} needs a draft checkpoint (draft=None): give draft, "
            f"or choose drafter {', '.join(map(repr, others))} or None"
        )
    if entry is not None and entry.loads is Loads.HEAD and draft_dir is None:
        raise InvalidConfigError(
            f"speculation.drafter={name!r} needs a head directory (draft=None): allowed a "
            f"directory written by specmix-train-draft --kind {name}"
        )
    if spec.prompt_lookup_min is not None and (entry is None or not entry.lookup_first):
        allowed = ", ".join(repr(e.name) for e in reg if e.lookup_first)
        raise InvalidConfigError(
            f"speculation.prompt_lookup_min={spec.prompt_lookup_min} needs a drafter to fall back on: allowed "
            f"drafter {allowed} (None with a draft checkpoint is 'model'); it is {name!r} ('ngram' is prompt "
            "lookup alone)"
        )
    if draft_dir is not None and (entry is None or entry.loads is Loads.NOTHING):
        users = [e.name for e in reg if e.loads is not Loads.NOTHING]
        raise InvalidConfigError(
            f"draft={str(draft_dir)!r} is given but speculation.drafter={name!r} does not use it: allowed "
            f"drafter {', '.join(map(repr, users))} (a draft checkpoint or a head directory, as it loads) or None"
        )
    if spec.draft_dtype is not None and (entry is None or entry.loads is not Loads.DRAFT_MODEL):
        raise InvalidConfigError(f"speculation.draft_dtype={spec.draft_dtype!r} needs a draft checkpoint (draft=None)")


def assemble(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    spec: SpeculationConfig,
    precision: PrecisionConfig | None,
    kernels: KernelOptions,
    dev: torch.device,
    dtype: str | torch.dtype | None,
) -> Parts:
    """Load, quantize (the plan), fuse projections, choose kernels, wrap in graphs, build the drafter."""
    entry = check_options(draft_dir, spec, precision, kernels, dev)
    models = load_models(target_dir, draft_dir, entry, spec, dtype, dev)
    if precision is not None:
        apply_precision_plan(precision.plan, models.target, models.draft_model, models.tokenizer, dev,
                             precision.calibration)  # fmt: skip
    choose_model_kernels(models, precision, kernels, dev)
    if entry is not None and entry.loads is Loads.HEAD:  # checked against the target (DraftMismatchError)
        assert draft_dir is not None
        module, hcfg, vocab_ids = load_head(draft_dir, models.target, models.tokenizer.vocab(), kind=entry.name)
        # the plan's draft part is the head's (its Linears FP8); the shared LM head stays the target's
        fp8 = [] if precision is None else apply_head_precision(precision.plan, module, entry.name)
        models.info["draft_head_fp8"] = fp8
        models.info["draft_dtype"] = str(next(module.parameters()).dtype).replace("torch.", "")
        models.head = LoadedHead(module, hcfg, vocab_ids)
    return parts_from_models(models, spec, kernels, dev)


def load_models(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    entry: DrafterEntry | None,
    spec: SpeculationConfig,
    dtype: str | torch.dtype | None,
    dev: torch.device,
) -> Models:
    """The target, its tokenizer and, for a drafter that loads one, the draft checkpoint (same vocabulary)."""
    dt = resolve_model_dtype(target_dir, dtype, dev)
    target = load_model(target_dir, dt, dev)
    tok = Tokenizer(target_dir)
    info = {"target_dir": str(target_dir), "draft_dir": None if draft_dir is None else str(draft_dir)}
    info["dtype"] = str(dt).replace("torch.", "")
    models = Models(target, tok, vocab=target.config.vocab_size, info=info)
    check_vocab_fits(tok, target.config.vocab_size, f"target {target_dir}")
    if entry is None or entry.loads is not Loads.DRAFT_MODEL:
        return models
    assert draft_dir is not None
    dtok = Tokenizer(draft_dir)
    ddt = resolve_dtype(spec.draft_dtype) if spec.draft_dtype else (torch.float32 if dev.type == "cpu" else dt)
    draft = load_model(draft_dir, ddt, dev)
    if dtok.vocab() != tok.vocab():
        raise VocabMismatchError(
            f"draft {draft_dir} and target {target_dir} have different vocabularies: "
            f"draft tokenizer has {dtok.vocab_size} tokens (model vocab {draft.config.vocab_size}), "
            f"target has {tok.vocab_size} (model vocab {target.config.vocab_size})"
        )
    check_vocab_fits(tok, draft.config.vocab_size, f"draft {draft_dir}")
    models.draft_model = draft
    models.vocab = min(target.config.vocab_size, draft.config.vocab_size)
    return models


def check_vocab_fits(tok: Tokenizer, rows: int, what: str) -> None:
    """Every id the tokenizer can produce (added tokens included) must have an embedding row in ``what``.

    Rows past the tokenizer's ids are padding it never emits: a draft with fewer of them than the target is
    accepted, and logits are cut to the common rows (docs/design.md, section "Vocabularies")."""
    bound = tok.id_bound()
    if bound > rows:
        raise VocabMismatchError(
            f"{what}: the tokenizer produces ids up to {bound - 1} (added tokens included) but the model has "
            f"{rows} embedding rows: allowed a tokenizer whose ids are all below the model's vocab_size"
        )


def choose_model_kernels(
    models: Models, precision: PrecisionConfig | None, kernels: KernelOptions, dev: torch.device
) -> None:
    """Fused projections, the CPU's linears and one-call steps, the attention backend; what ran goes to info."""
    target, draft = models.target, models.draft_model
    # q/k/v and gate/up as one GEMM each where they are plain Linears (after the plan's swaps)
    fused = fuse_projections(target) + (fuse_projections(draft) if draft is not None else 0)
    # the CPU linears on the fast kernel for the weights' dtype after any plan (a CPU plan computes in fp32)
    packed, cpu_kernel = fast_cpu_linears(target, dev, kernels.cpu_pack)
    if precision is None:
        default = "math" if cpu_kernel == "onednn-bf16" else "sdpa"
        target.use_kernels(attention=select_attention(kernels.attention or default, dev))
    # each fp32 model's few-row forward as one C++ call; GEMM weights 16-bit where lossless ("auto": else
    # fp16, for the draft: the target verifies every proposal, so only the acceptance can move)
    step_w = {"target": None, "draft": kernels.draft_step_weights or "auto"}
    stepped = [
        name
        for name, m in (("target", target), ("draft", draft))  # (a reason is logged)
        if dev.type == "cpu" and kernels.cpu_pack is not False and m is not None
        and install_decode_step(m, step_w[name]) is None
    ]  # fmt: skip
    models.cpu_kernels = cpu_kernel == KERNEL_NAME
    models.info.update(
        draft_dtype=None if draft is None else str(draft.dtype).replace("torch.", ""),
        fused_projection_groups=fused,
        cpu_packed_linears=packed,
        cpu_linear_kernel=cpu_kernel,
        cpu_decode_step=stepped,
        **step_info({"target": target, "draft": draft}),
        attention=target.attn_fn.name,
        cpu_packed_mib=round(packed_bytes(target) / 2**20, 1),
    )


def parts_from_models(models: Models, spec: SpeculationConfig, kernels: KernelOptions, dev: torch.device) -> Parts:
    """Parts over models already built (kernels chosen): CUDA graphs when asked, the drafter, the K policy."""
    entry = drafter_entry(models.draft_model if models.head is None else models.head, spec)
    target_fwd: CachedForward = models.target
    draft_fwd: CachedForward | None = models.draft_model
    graphs: list[GraphedForward | GraphedStep] = []
    if kernels.cuda_graphs:
        k_max = spec.resolved_k_max if entry else 0  # (a graph is captured on first use: a larger bound costs nothing)
        tg, dg = graph_forwards(
            models.target, models.draft_model, k_max, kernels.batch_buckets, emulate=kernels.emulate_graphs
        )
        target_fwd, draft_fwd = tg, (dg if dg is not None else models.draft_model)
        graphs = [tg] + ([dg] if dg is not None else [])
    chooser = DraftKernelChooser(
        device=dev, cpu_kernels=models.cpu_kernels, store=kernels.draft_step_weights, cuda_graphs=kernels.cuda_graphs,
        batch_buckets=kernels.batch_buckets, emulate=kernels.emulate_graphs, pool=graphs[0].pool if graphs else None,
    )  # fmt: skip
    drafter = None
    if entry is not None:
        ctx = DrafterContext(
            target=target_fwd, target_module=models.target, kernels=chooser, draft_model=draft_fwd,
            draft_module=models.draft_model, head=models.head, options=spec.drafter_options(entry),
        )  # fmt: skip
        drafter = build_drafter(entry, ctx, spec.prompt_lookup_min)
    graphs += chooser.graphs
    policy = None if drafter is None or entry is None else k_policy(spec, drafter, entry.trees)
    lookup = spec.prompt_lookup_min if drafter is not None else None
    info = {**models.info, **chooser.chosen, "drafter": entry.name if drafter else None, "prompt_lookup_min": lookup}
    return Parts(
        target=models.target, tokenizer=models.tokenizer, draft_model=models.draft_model, drafter=drafter,
        policy=policy, vocab=models.vocab or models.target.config.vocab_size, device=dev, target_forward=target_fwd,
        graphs=graphs, info=info,
    )  # fmt: skip


def k_policy(spec: SpeculationConfig, drafter: Drafter, trees: bool) -> KPolicy:
    """The K policy of ``spec``, K capped at the most drafts a round of ``drafter`` can use (Medusa: its heads);
    ``trees``: the drafter's registry entry drafts trees (then with ``tree_branches`` > 1 it does)."""
    k_max = spec.resolved_k_max if drafter.max_drafts is None else min(spec.resolved_k_max, drafter.max_drafts)
    k = min(spec.k, k_max)
    tree = trees and (spec.tree_branches or 1) > 1
    return KPolicy(name=spec.k_policy, k=k, k_min=min(spec.k_min, k), k_max=k_max, trees=tree, draft_cut=spec.draft_cut)
