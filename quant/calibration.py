"""What the planner's search measures on the calibration text: the unquantized model's reference log-probs and
FFN inputs (``Calibration``), each FFN Linear's output error per candidate on its own inputs (``module_errors``),
and a model's KLD against the reference (``calib_kld``). Never the eval text."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.errors import InvalidConfigError

from .candidates import Choice
from .linear import Int8Linear
from .plan_schema import FAMILY_MODULES

# ---------------------------------------------------------------------------- calibration data


@dataclass
class Calibration:
    """What the search needs from the unquantized model on the calibration windows."""

    windows: list[Tensor]  # LongTensors [1, T]
    ref_logprobs: list[Tensor]  # fp32 [T, V] per window
    inputs: dict[str, Tensor]  # per FFN Linear: its input on the first ``sample`` tokens [S, K]
    absmax: dict[str, Tensor]  # per FFN Linear: per-input-channel absmax over every calibration token


def ffn_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's unquantized FFN Linears by name (``layers.{i}.mlp.{leaf}``)."""
    out = {}
    for i, layer in enumerate(model.layers):
        for leaf in FAMILY_MODULES["ffn"]:
            m = getattr(layer.mlp, leaf)
            if isinstance(m, nn.Linear):
                out[f"layers.{i}.mlp.{leaf}"] = m
    return out


def collect_calibration(
    model: nn.Module, windows: Iterable[Tensor], sample: int = 512, kld_windows: int | None = None
) -> Calibration:
    """Reference log-probs (of the first ``kld_windows`` windows; None: all), sampled FFN inputs and their
    absmax (over every window, as quant.apply.collect_activation_stats on the same windows), in one pass."""
    wins = [w if w.dim() == 2 else w[None] for w in windows]
    if not wins or sum(w.numel() for w in wins) == 0:
        raise InvalidConfigError("calibration windows are empty: the search needs calibration text")
    linears = ffn_linears(model)
    if not linears:
        raise InvalidConfigError("the model has no unquantized FFN Linear to plan")
    inputs: dict[str, list[Tensor]] = {n: [] for n in linears}
    absmax: dict[str, Tensor] = {}
    taken = {"n": 0}

    def hook(name: str) -> Callable[..., None]:
        def fn(_m: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            a = x.abs().amax(dim=0)
            absmax[name] = a if name not in absmax else torch.maximum(absmax[name], a)
            room = sample - taken["n"]
            if room > 0:
                inputs[name].append(x[:room].clone())

        return fn

    device = model.norm.weight.device
    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    refs = []
    try:
        with torch.inference_mode():
            for i, w in enumerate(wins):
                out = model(w.to(device))
                if kld_windows is None or i < kld_windows:
                    refs.append(F.log_softmax(out[0].float(), dim=-1).cpu())
                taken["n"] += w.shape[1]
    finally:
        for h in hooks:
            h.remove()
    return Calibration(wins[: len(refs)], refs, {n: torch.cat(v) for n, v in inputs.items()}, absmax)


# ---------------------------------------------------------------------------- per-module damage

ALPHA_GRID = (0.25, 0.4, 0.55, 0.7, 0.85)  # SmoothQuant alphas tried per w8a8 module


def quantize_choice(lin: nn.Linear, choice: Choice, absmax: Tensor | None, alpha: float | None) -> Int8Linear:
    """``lin`` quantized as ``choice`` (w8a8: SmoothQuant at ``alpha`` over the inputs' ``absmax``)."""
    if choice.kernel == "w8a8":
        return Int8Linear.from_float(lin, "w8a8", act_absmax=absmax, alpha=alpha if alpha is not None else 0.5)
    return Int8Linear.from_float(lin, "w8a16", group_size=choice.group_size)


def rel_err(y: Tensor, ref: Tensor) -> float:
    """||y - ref|| / ||ref||."""
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def module_errors(
    model: nn.Module, calib: Calibration, choices: list[Choice], alphas: tuple[float, ...] = ALPHA_GRID
) -> dict[str, dict[str, tuple[float, float | None]]]:
    """Per FFN Linear and candidate: (relative output error on its calibration inputs, SmoothQuant alpha)."""
    out: dict[str, dict[str, tuple[float, float | None]]] = {}
    with torch.inference_mode():
        for name, lin in ffn_linears(model).items():
            x = calib.inputs[name].to(lin.weight.device, lin.weight.dtype)
            ref = lin(x).float()
            errs: dict[str, tuple[float, float | None]] = {}
            for c in choices:
                if c.kernel == "dense":
                    errs[c.label] = (0.0, None)
                elif c.kernel == "w8a8":
                    errs[c.label] = min(
                        (rel_err(quantize_choice(lin, c, calib.absmax[name], a)(x), ref), a) for a in alphas
                    )
                else:
                    errs[c.label] = (rel_err(quantize_choice(lin, c, None, None)(x), ref), None)
            out[name] = errs
    return out


# ---------------------------------------------------------------------------- the model's KLD


def calib_kld(model: nn.Module, calib: Calibration) -> tuple[float, float]:
    """(mean KL(ref || model), top-1 agreement) over every calibration token."""
    device = model.norm.weight.device
    kl_sum, agree, n = 0.0, 0.0, 0
    with torch.inference_mode():
        for w, lr in zip(calib.windows, calib.ref_logprobs):
            lt = F.log_softmax(model(w.to(device))[0].float(), dim=-1).cpu()
            kl_sum += float((lr.exp() * (lr - lt)).sum(-1).double().sum())
            agree += float((lr.argmax(-1) == lt.argmax(-1)).double().sum())
            n += lr.shape[0]
    return kl_sum / n, agree / n
