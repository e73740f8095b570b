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
from torch import nn

from engine.api.options import KernelOptions, PrecisionConfig, SpeculationConfig
from engine.api.plan_apply import apply_head_precision, apply_precision_plan
from engine.core.checkpoint import load_model, resolve_dtype
from engine.core.config import checkpoint_dtype
from engine.core.errors import InvalidConfigError, VocabMismatchError
from engine.core.model import Transformer, fuse_projections
from engine.core.tokenizer import Tokenizer
from engine.kernels.backends import select_attention
from engine.kernels.cpu_decode import install_decode_step, step_info
from engine.kernels.cpu_gemm import KERNEL_NAME
from engine.kernels.cpu_head import (
    AttnHeadKernel,
    EagleKernel,
    MedusaKernel,
    head_kernel_reason,
    head_store_dtype,
    scorer_on_kernel,
)
from engine.kernels.cpu_linear import fast_cpu_linears, packed_bytes
from engine.kernels.cudagraphs import GraphedForward, graph_forwards
from engine.kernels.head_graphs import GraphedStep
from engine.spec_decode.adaptive import KPolicy
from engine.spec_decode.drafters.base import Drafter, EarlyExitDrafter, ModelDrafter, NGramDrafter
from engine.spec_decode.drafters.heads import HEAD_DRAFTERS, EagleAttnDrafter, HeadDrafter
from engine.spec_decode.drafters.lookup import LookupFirst
from engine.spec_decode.heads.checkpoint import HeadConfig, draft_lm_head, load_head

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
    target_forward: Any  # the target, or its graphed forward
    graphs: list[GraphedForward | GraphedStep] = field(default_factory=list)
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


def check_options(
    draft_dir: Any,
    spec: SpeculationConfig,
    precision: PrecisionConfig | None,
    kernels: KernelOptions,
    dev: torch.device,
) -> str | None:
    """The drafter to build; InvalidConfigError for options that contradict each other or the models."""
    drafter = spec.drafter if spec.drafter is not None else ("model" if draft_dir is not None else None)
    if drafter == "model" and draft_dir is None:
        raise InvalidConfigError(
            "speculation.drafter='model' needs a draft checkpoint (draft=None): give draft, "
            "or choose drafter 'ngram', 'early-exit' or None"
        )
    if drafter in HEAD_DRAFTERS and draft_dir is None:
        raise InvalidConfigError(
            f"speculation.drafter={drafter!r} needs a head directory (draft=None): allowed a "
            f"directory written by specmix-train-draft --kind {drafter}"
        )
    if spec.prompt_lookup_min is not None and drafter in (None, "ngram"):
        raise InvalidConfigError(
            f"speculation.prompt_lookup_min={spec.prompt_lookup_min} needs a drafter to fall back on: allowed "
            f"drafter 'model' (or None with a draft checkpoint), 'early-exit', 'medusa' or 'eagle'; it is "
            f"{drafter!r} ('ngram' is prompt lookup alone)"
        )
    if drafter not in ("model", *HEAD_DRAFTERS) and draft_dir is not None:
        raise InvalidConfigError(
            f"draft={str(draft_dir)!r} is given but speculation.drafter={drafter!r} does not "
            "use it: allowed drafter='model' (or None) with a draft checkpoint, 'medusa' or "
            "'eagle' with a head directory"
        )
    if spec.draft_dtype is not None and drafter != "model":
        raise InvalidConfigError(f"speculation.draft_dtype={spec.draft_dtype!r} needs a draft checkpoint (draft=None)")
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
    return drafter


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
    drafter_name = check_options(draft_dir, spec, precision, kernels, dev)
    dt = resolve_model_dtype(target_dir, dtype, dev)
    target = load_model(target_dir, dt, dev)
    tok = Tokenizer(target_dir)
    draft_model: Transformer | None = None
    vocab = target.config.vocab_size
    if drafter_name == "model":
        assert draft_dir is not None
        dtok = Tokenizer(draft_dir)
        ddt = resolve_dtype(spec.draft_dtype) if spec.draft_dtype else (torch.float32 if dev.type == "cpu" else dt)
        draft_model = load_model(draft_dir, ddt, dev)
        if dtok.vocab() != tok.vocab():
            raise VocabMismatchError(
                f"draft {draft_dir} and target {target_dir} have different vocabularies: "
                f"draft tokenizer has {dtok.vocab_size} tokens (model vocab {draft_model.config.vocab_size}), "
                f"target has {tok.vocab_size} (model vocab {target.config.vocab_size})"
            )
        vocab = min(vocab, draft_model.config.vocab_size)
    if precision is not None:
        apply_precision_plan(precision.plan, target, draft_model, tok, dev, precision.calibration)
    # q/k/v and gate/up as one GEMM each where they are plain Linears (after the plan's swaps)
    fused = fuse_projections(target) + (fuse_projections(draft_model) if draft_model is not None else 0)
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
        for name, m in (("target", target), ("draft", draft_model))  # (a reason is logged)
        if dev.type == "cpu"
        and kernels.cpu_pack is not False
        and m is not None
        and install_decode_step(m, step_w[name]) is None
    ]
    info = {
        "target_dir": str(target_dir),
        "draft_dir": None if draft_dir is None else str(draft_dir),
        "dtype": str(dt).replace("torch.", ""),
        "draft_dtype": None if draft_model is None else str(draft_model.dtype).replace("torch.", ""),
        "fused_projection_groups": fused,
        "cpu_packed_linears": packed,
        "cpu_linear_kernel": cpu_kernel,
        "cpu_decode_step": stepped,
        **step_info({"target": target, "draft": draft_model}),
        "attention": getattr(target.attn_fn, "__name__", type(target.attn_fn).__name__),
        "cpu_packed_mib": round(packed_bytes(target) / 2**20, 1),
    }
    head = None
    if drafter_name in HEAD_DRAFTERS:  # checked against the target (DraftMismatchError), in its dtype
        assert draft_dir is not None
        module, hcfg, vocab_ids = load_head(draft_dir, target, tok.vocab(), kind=drafter_name)
        # the plan's draft part is the head's (its Linears FP8); the shared LM head stays the target's
        fp8 = [] if precision is None else apply_head_precision(precision.plan, module, drafter_name)
        info["draft_head_fp8"] = fp8
        info["draft_dtype"] = str(next(module.parameters()).dtype).replace("torch.", "")
        head = head_drafter(drafter_name, module, hcfg, vocab_ids, target, kernels, cpu_kernel == KERNEL_NAME, info)
    return parts_from_models(target, tok, draft_model, drafter_name, spec, kernels, dev, vocab, info, head)


def head_drafter(
    kind: str,
    module: nn.Module,
    cfg: HeadConfig,
    vocab_ids: torch.Tensor | None,
    target: Transformer,
    kernels: KernelOptions,
    cpu_kernels: bool,
    info: dict[str, Any],
) -> HeadDrafter:
    """The drafter of a loaded head; ``cpu_kernels`` (the fp32 target runs on the few-row CPU kernel): the
    head's step as one C++ call (its GEMM weights stored per ``kernels.draft_step_weights``) and the PyTorch
    step's scorer on the few-row GEMM. ``info["draft_head_step_weights"]``: the C++ step's GEMM weight dtype,
    or None (PyTorch's step)."""
    scorer: nn.Module = draft_lm_head(target, vocab_ids)
    info["draft_head_step_weights"] = None
    if cfg.attention:  # decoder layers with a KV cache: the decode step's kernel or PyTorch's layers
        fuse_projections(module)  # q/k/v and gate/up as one GEMM each, as the target's (and the kernel's layout)
        why = "the target is not on the CPU kernels" if not cpu_kernels else None
        if any(m.bias is not None for layer in module.layers for m in (layer.mlp.gate_proj, layer.mlp.up_proj)):
            why = why or "the kernel has no gate/up bias (mlp_bias)"
        ws = module.kernel_weights()  # type: ignore[operator]
        why = why or head_kernel_reason([*ws, scorer.weight])
        if why is not None:
            log.info("the eagle head's layers stay on PyTorch: %s", why)
            return EagleAttnDrafter(module, cfg, vocab_ids, target, lm_head=scorer_on_kernel(scorer))
        store = head_store_dtype([w for w in ws if w is not None], kernels.draft_step_weights)
        info["draft_head_step_weights"] = str(store).replace("torch.", "")
        runner = AttnHeadKernel(module, scorer.weight, store)
        return EagleAttnDrafter(module, cfg, vocab_ids, target, runner=runner, lm_head=scorer)
    if not cpu_kernels or kernels.cuda_graphs:  # (graphs capture the PyTorch step)
        return HEAD_DRAFTERS[kind](module, cfg, vocab_ids, target, lm_head=scorer)
    scorer = scorer_on_kernel(scorer)
    weights, lm, embed = module.kernel_weights(), scorer.weight, target.embed_tokens.weight  # type: ignore[operator]
    why = head_kernel_reason([*weights, lm, embed] if kind == "eagle" else [*weights, lm])
    if why is not None:
        log.info("the %s head's step stays on PyTorch: %s", kind, why)
        return HEAD_DRAFTERS[kind](module, cfg, vocab_ids, target, lm_head=scorer)
    store = head_store_dtype([w for w in weights if w.dim() >= 2], kernels.draft_step_weights)
    step: EagleKernel | MedusaKernel
    if kind == "eagle":
        step = EagleKernel(weights, embed, lm, vocab_ids, cfg.rms_norm_eps, store)
    else:
        step = MedusaKernel(weights[0], weights[1], lm, vocab_ids, cfg.vocab_size, store)
    info["draft_head_step_weights"] = str(store).replace("torch.", "")
    return HEAD_DRAFTERS[kind](module, cfg, vocab_ids, target, runner=step, lm_head=scorer, greedy=step.greedy)


def parts_from_models(
    target: Transformer,
    tokenizer: Any,
    draft_model: Transformer | None,
    drafter: str | None,
    spec: SpeculationConfig,
    kernels: KernelOptions,
    dev: torch.device,
    vocab: int | None = None,
    info: dict[str, Any] | None = None,
    head: HeadDrafter | None = None,
) -> Parts:
    """Parts over models already built (kernels chosen): CUDA graphs when asked, the drafter, the K policy.
    ``head``: the drafter of a trained head (medusa / eagle), built by ``assemble``."""
    k_max, k = spec.resolved_k_max, spec.k
    if head is not None and head.cfg.max_drafts is not None:  # medusa: one draft per head
        k_max = min(k_max, head.cfg.max_drafts)
        k = min(k, k_max)
    target_fwd: Any = target
    draft_fwd: Any = draft_model
    graphs: list[GraphedForward | GraphedStep] = []
    if kernels.cuda_graphs:
        tg, dg = graph_forwards(
            target, draft_model, k_max if drafter else 0, kernels.batch_buckets, emulate=kernels.emulate_graphs
        )
        target_fwd, draft_fwd = tg, (dg if dg is not None else draft_model)
        graphs = [tg] + ([dg] if dg is not None else [])
        if head is not None:  # the head's step (its forward and the shared LM head's scores) per batch bucket
            runner = GraphedStep(
                head.step,
                head.head_weight.device,
                kernels.batch_buckets,
                emulate=kernels.emulate_graphs,
                pool=tg.pool,
                name=f"{drafter} head step",
            )
            head = head.with_runner(runner)
            graphs.append(runner)
    d = (
        head
        if head is not None
        else make_drafter(drafter, target_fwd, draft_fwd, target.config.num_hidden_layers, spec)
    )
    if d is not None and spec.prompt_lookup_min is not None:
        d = LookupFirst(d, spec.prompt_lookup_min)
    policy = KPolicy(name=spec.k_policy, k=k, k_min=min(spec.k_min, k), k_max=k_max) if d is not None else None
    lookup = spec.prompt_lookup_min if d is not None else None
    info = {**(info or {}), "drafter": drafter if d is not None else None, "prompt_lookup_min": lookup}
    return Parts(
        target=target,
        tokenizer=tokenizer,
        draft_model=draft_model,
        drafter=d,
        policy=policy,
        vocab=vocab or target.config.vocab_size,
        device=dev,
        target_forward=target_fwd,
        graphs=graphs,
        info=info,
    )


def make_drafter(
    name: str | None, target_fwd: Any, draft_fwd: Any, n_layers: int, spec: SpeculationConfig
) -> Drafter | None:
    if name == "model":
        return ModelDrafter(draft_fwd, None)
    if name == "ngram":
        return NGramDrafter()
    if name == "early-exit":
        L = spec.early_exit_layers if spec.early_exit_layers is not None else max(1, n_layers // 4)
        if not 1 <= L < n_layers:
            raise InvalidConfigError(f"speculation.early_exit_layers={L!r} is invalid: allowed 1..{n_layers - 1}")
        return EarlyExitDrafter(target_fwd, L)
    return None
