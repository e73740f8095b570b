#!/usr/bin/env python
"""Export a profile's planned draft and target as ONNX graphs of one decode/verify step.

    python tools/export_onnx.py                                  # profiles/a100-80gb-demo.json
    python tools/export_onnx.py --profile P.json --out DIR [--no-check] [--steps 8]

Writes DIR/target.onnx, DIR/draft.onnx (when the profile drafts with a model) and
DIR/manifest.json (inputs/outputs, opset, quantization, parity), each atomically. Default
DIR: build/onnx/<profile name>. Each graph takes input_ids and positions [batch, step]
and past_key_values.{i}.key/.value [batch, kv_heads, past_seq, head_dim] and returns
logits [batch, step, vocab] and present.{i}.key/.value (past ++ new): the caller keeps the
cache (engine/export/onnx_export.py). The target's INT8 FFN is int8 weights -> DequantizeLinear
with per-token dynamic int8 QuantizeLinear/DequantizeLinear of the activations (W8A8 as
specmix runs it, SmoothQuant divide included); the FP8 draft keeps its e4m3 weights as
FLOAT8E4M3FN initializers -> DequantizeLinear (onnxruntime runs them on the CPU).

Unless --no-check, onnxruntime (CPU) runs a prefill and --steps greedy decode steps and a
4-token verify step, and the manifest records max and mean |ONNX - specmix| for each graph
next to the quantization error |specmix planned - specmix unquantized| and specmix's own
one-ulp sensitivity (engine/export/onnx_export.py Parity), and each quantized Linear alone on the
inputs it sees in specmix (module_parity). A graph passes when max |diff| <= --max-rel of
the logit scale, or, quantized, when max |diff| <= its quantization error's max and mean
|diff| <= a fifth of its mean; and its quantized Linears match specmix's to --max-rel with
identical quantized activations.

Exit status: 0 written; 1 the parity check failed (the files are still written); 2 bad
input (one line on stderr).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from engine.core.cli import OneLineParser, run_tool
from engine.core.errors import InvalidConfigError

log = logging.getLogger("export_onnx")
PROG = "export_onnx"

DEFAULT_PROFILE = Path("profiles") / "a100-80gb-demo.json"
PROMPTS = ("def fibonacci(n):\n    if n < 2:\n        return n", "The with statement is used to wrap the execution")


def _int_at_least(lo: int, name: str) -> Any:
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = lo - 1
        if v < lo:
            raise argparse.ArgumentTypeError(f"{name}={text!r} is invalid: allowed an int >= {lo}")
        return v

    return conv


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"--max-rel={text!r} is invalid: allowed a number > 0")
    return v


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="export_onnx.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--profile",
        type=Path,
        help=f"profile JSON (default: {DEFAULT_PROFILE}, built by python tools/build_profile.py --gpu a100)",
    )
    p.add_argument("--out", type=Path, help="output directory (default: build/onnx/<profile name>)")
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime parity check")
    p.add_argument("--steps", type=_int_at_least(0, "--steps"), default=8, help="decode steps checked (default 8)")
    p.add_argument(
        "--max-rel",
        type=_positive_float,
        default=1e-3,
        help="bound on max |ONNX - specmix| / max |specmix logits| (default 1e-3)",
    )
    p.add_argument("--quiet", action="store_true", help="warnings only")
    return p.parse_args(argv)


def _prompt(tokenizer: Any, vocab: int) -> Any:
    import torch

    rows = [[t for t in tokenizer.encode(s) if t < vocab] for s in PROMPTS]
    n = min(len(r) for r in rows)
    if n == 0:
        from engine.core.errors import InvalidConfigError

        raise InvalidConfigError("the tokenizer encodes the check prompts to nothing: use --no-check")
    return torch.tensor([r[:n] for r in rows], dtype=torch.long)


def _out_dir(a: argparse.Namespace) -> Path:
    """--out, else build/onnx/<profile name>."""
    return a.out if a.out is not None else Path("build") / "onnx" / a.profile.stem


def _models(eng: Any, profile: Path) -> dict[str, Any]:
    """The models to export by role: the target, and the draft when the profile drafts with a model."""
    models = {"target": eng.target}
    if eng.draft_model is not None:
        models["draft"] = eng.draft_model
    else:
        log.warning("%s drafts with %r: no draft model to export", profile, eng.info.get("drafter"))
    return models


def _check(a: argparse.Namespace, eng: Any, role: str, model: Any, path: Path, ref_dir: Any) -> dict[str, Any]:
    """The parity of ``role``'s graph at ``path`` with specmix's ``model`` (engine/export/onnx_export.py), its
    quantization error against the unquantized checkpoint ``ref_dir``, and whether it passes; logged."""
    from engine.core.checkpoint import load_model
    from engine.export.onnx_export import OnnxStep, decode_parity, module_parity

    ref = load_model(ref_dir, "float32", "cpu")
    prompt = _prompt(eng.tokenizer, model.config.vocab_size)
    rep = decode_parity(model, OnnxStep(path), prompt, a.steps, reference=ref, verify=4, floor=True)
    mods = module_parity(model, prompt)
    ok = rep.passed(a.max_rel) and mods["max_rel"] <= a.max_rel and mods["quantized_activations_differing"] == 0
    log.info(
        "%s: %d quantized modules on specmix's inputs: max rel diff %.3g, %d of %d quantized activations differ",
        role,
        mods["modules"],
        mods["max_rel"],
        mods["quantized_activations_differing"],
        mods["quantized_activations"],
    )
    log.info(
        "%s: |onnx - specmix| max %.3g mean %.3g; quantization error max %.3g mean %.3g; one-ulp floor "
        "max %.3g mean %.3g",
        role,
        rep.max_abs,
        rep.mean_abs,
        rep.ref_max_abs,
        rep.ref_mean_abs,
        rep.floor_max_abs,
        rep.floor_mean_abs,
    )
    return {**rep.to_dict(), "modules": mods, "passed": ok}


def _parity_check(a: argparse.Namespace, parity: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest's account of the parity check (what, the rule, passed); None with --no-check."""
    if a.no_check:
        return None
    return {
        "what": f"prefill of {len(PROMPTS)} prompts, {a.steps} greedy decode steps and one 4-token verify "
        "step: onnxruntime CPU vs specmix as planned (max/mean), specmix as planned vs unquantized "
        "(ref_*: the quantization error), specmix as planned vs itself with its embedding and RMSNorm "
        "outputs moved one ulp (floor_*: its float32 rounding sensitivity)",
        "modules": "each quantized Linear alone as an ONNX graph fed the inputs it sees in a specmix "
        "prefill: worst output diff relative to the output scale, quantized activations that "
        "differ from specmix's",
        "rule": f"(max_rel <= {a.max_rel:g}, or max_abs <= ref_max_abs and mean_abs <= 0.2 ref_mean_abs) "
        f"and modules.max_rel <= {a.max_rel:g} and no quantized activation differs",
        "passed": all(p["passed"] for p in parity.values()),
    }


def export(a: argparse.Namespace) -> dict[str, Any]:
    """Export (and check) the profile's models; returns the manifest written."""
    import onnx  # noqa: F401  (fail early, before loading models, when the extra is missing)

    from engine import Engine
    from engine.core.files import write_json_atomic
    from engine.export.onnx_export import IR_VERSION, OPSET, export_step

    eng = Engine.from_profile(a.profile)
    out = _out_dir(a)
    models = _models(eng, a.profile)
    dirs = {"target": eng.info["target_dir"], "draft": eng.info["draft_dir"]}
    graphs, parity = {}, {}
    for role, model in models.items():
        path = out / f"{role}.onnx"
        graphs[role] = export_step(model, path)
        if not a.no_check:
            parity[role] = _check(a, eng, role, model, path, dirs[role])
    import onnxruntime

    manifest = {
        "profile": str(a.profile),
        "opset": OPSET,
        "ir_version": IR_VERSION,
        "versions": {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
        "cache": "the caller keeps it: feed present.{i}.* back as past_key_values.{i}.*; slot = position, "
        "rows share past_seq; a rollback slices present to the accepted length (axis 2)",
        "precision": eng.profile.precision if eng.profile else None,
        "graphs": graphs,
        "parity": parity or None,
        "parity_check": _parity_check(a, parity),
    }
    write_json_atomic(out / "manifest.json", manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    return run_tool(PROG, lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO, format="%(message)s")
    if a.profile is None:
        a.profile = Path(DEFAULT_PROFILE)
        if not a.profile.is_file():
            raise InvalidConfigError(
                f"the default profile {DEFAULT_PROFILE} is missing: build it with "
                "python tools/build_profile.py --gpu a100, or pass --profile FILE"
            )
    try:
        m = export(a)
    except ImportError as e:
        raise InvalidConfigError(f"{e.name or e}: install the onnx extra (pip install -e '.[onnx]')") from None
    for role, g in m["graphs"].items():
        p = (m["parity"] or {}).get(role)
        fig = (
            ""
            if p is None
            else (
                f": |onnx - specmix| max {p['max_abs']:.3g} mean {p['mean_abs']:.3g} "
                f"(quantization error max {p['ref_max_abs']:.3g} mean {p['ref_mean_abs']:.3g}; "
                f"one-ulp floor max {p['floor_max_abs']:.3g} mean {p['floor_mean_abs']:.3g})"
            )
        )
        print(f"{role}: {g['file']}{fig}")
    chk = m["parity_check"]
    if chk is not None and not chk["passed"]:
        print(f"{PROG}: parity check failed ({chk['rule']})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
