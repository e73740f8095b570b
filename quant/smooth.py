"""SmoothQuant (Xiao et al. 2023): move activation outliers into the weights.

For a Linear ``y = x W^T`` with per-input-channel activation absmax ``a_j``
(from calibration text) and weight absmax ``w_j`` (column j of W), the factor

    s_j = a_j ** alpha / w_j ** (1 - alpha)        (alpha = 0.5 by default)

gives ``y = (x / s) (W * s)^T`` exactly; ``x / s`` has flatter channels, so
per-token INT8 loses less. specmix folds ``s`` into the weight before it is
quantized and divides the activation by ``s`` at run time inside the module
(a per-module divide; folding it into the preceding RMSNorm would need gate and
up to share one ``s`` and does not apply to down_proj).
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.core.errors import InvalidConfigError

DEFAULT_ALPHA = 0.5
_MIN_SCALE = 1e-5


def smooth_scales(act_absmax: Tensor, weight: Tensor, alpha: float = DEFAULT_ALPHA) -> Tensor:
    """Per-input-channel smoothing factors ``s`` [in] (float32) for ``weight`` [out, in].

    Channels whose activation or weight is all zero get ``s = 1`` (nothing to move).
    """
    if not 0.0 <= alpha <= 1.0:
        raise InvalidConfigError(f"smoothquant alpha={alpha!r} is invalid: allowed 0.0 .. 1.0")
    a = act_absmax.detach().float().to(weight.device)
    if a.shape != (weight.shape[1],):
        raise InvalidConfigError(
            f"activation absmax has shape {tuple(a.shape)}; expected ({weight.shape[1]},) (the Linear's in_features)"
        )
    if not torch.isfinite(a).all():
        raise InvalidConfigError("activation absmax holds NaN or inf; recollect the calibration statistics")
    w = weight.detach().float().abs().amax(dim=0)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    ok = (a > 0) & (w > 0) & torch.isfinite(s)
    return torch.where(ok, s.clamp(min=_MIN_SCALE), torch.ones_like(s))
