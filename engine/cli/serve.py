"""``specmix-serve`` (and tools/serve.py): an OpenAI-compatible server over a profile or a checkpoint.

    specmix-serve --profile FILE [--host H] [--port N]
    specmix-serve --target DIR|owner/name [--draft DIR|owner/name] [--k 5] [--k-policy measured]
    specmix-serve ... --api-key KEY (or SPECMIX_API_KEY) [--allowed-origins URL ...] [--max-body-bytes N ...]

Needs the ``serve`` extra (``pip install -e '.[serve]'``: FastAPI, uvicorn, prometheus_client).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.server.options import AccessOptions, RequestLimits
from engine.spec_decode.registry import DRAFTERS, Loads

log = logging.getLogger("specmix.serve")

GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_new_tokens",
}


def generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults of a checkpoint's generation_config.json (those SamplingParams knows)."""
    f = Path(model_dir) / "generation_config.json"
    if not f.is_file():
        return {}
    from engine.core.errors import CheckpointError

    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: expected a JSON object, got {type(cfg).__name__}")
    out = {ours: cfg[theirs] for theirs, ours in GENERATION_KEYS.items() if cfg.get(theirs) is not None}
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0  # transformers decodes greedily then, whatever the temperature says
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specmix-serve", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="a built profile (tools/build_profile.py)")
    src.add_argument("--target", help="target checkpoint: a directory or a Hugging Face Hub id owner/name")
    ap.add_argument(
        "--draft", help="draft checkpoint (directory or Hub id) or a trained head (specmix-train-draft), with --target"
    )
    ap.add_argument(
        "--drafter",
        default=None,
        choices=DRAFTERS.names(),
        help="default: the head's kind for a head directory, model for another --draft, else none",
    )
    ap.add_argument(
        "--no-spec",
        action="store_true",
        default=None,
        help="decode plainly (speculation off; with --profile: its target on its plan, no drafter)",
    )
    ap.add_argument("--k", type=int, default=None, help="drafts per round to start from (default 5)")
    ap.add_argument("--k-policy", default=None, help="measured (default), cost-model, heuristic, constant")
    ap.add_argument(
        "--prompt-lookup",
        type=int,
        default=None,
        metavar="N",
        help="draft by prompt lookup where the last N or more tokens recur in the context, the drafter elsewhere",
    )
    ap.add_argument(
        "--tree-branches",
        type=int,
        default=None,
        metavar="N",
        help="draft trees with up to N children per node, for the drafters that draft trees (default: chains)",
    )
    ap.add_argument(
        "--suffix-global-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the suffix drafter's tree over recent requests' outputs, in tokens (0: none; default 2**20)",
    )
    ap.add_argument(
        "--no-draft-cut",
        action="store_true",
        default=None,
        help="--drafter ngram with the measured K policy: greedy rows' chains are not cut where a draft does not pay",
    )
    ap.add_argument(
        "--full-check",
        action="store_true",
        help="re-hash every weight file of the profile (default: only files whose size/mtime changed)",
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--served-model-name", default=None, help="the model name clients send (default: the target)")
    ap.add_argument(
        "--generation-config",
        choices=["auto", "none"],
        default="none",
        help="auto: the target's generation_config.json gives the sampling defaults",
    )
    ap.add_argument("--hub-cache-dir", default=None, help="huggingface_hub cache (default: HF_HUB_CACHE)")
    ap.add_argument("--offline", action="store_true", help="resolve Hub ids from the local cache only")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-waiting", type=int, default=256)
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument(
        "--prefill-chunk", type=int, default=None,
        help="prompt tokens prefilled while others decode, per token a decoding row gets in a round (0: a prompt "
        "prefills whole; default: engine/api/options.py's Limits)",
    )  # fmt: skip
    ap.add_argument("--log-level", default="info")
    _add_http_args(ap)
    return ap


def _add_http_args(ap: argparse.ArgumentParser) -> None:
    """Access control and the limits of one request (engine/server/access.py, engine/server/limits.py)."""
    ap.add_argument(
        "--api-key",
        default=None,
        help="clients must send Authorization: Bearer KEY (default: $SPECMIX_API_KEY; unset: no key needed)",
    )
    ap.add_argument(
        "--protect-health-metrics", action="store_true", help="with --api-key, /health and /metrics need the key too"
    )
    ap.add_argument(
        "--allowed-origins", nargs="+", default=[], metavar="ORIGIN", help="CORS origins ('*' for any; default: off)"
    )
    d = RequestLimits()
    ap.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="request body size (413 beyond)")
    ap.add_argument("--max-prompts", type=int, default=d.max_prompts, help="prompts in one completions request")
    ap.add_argument("--max-n", type=int, default=d.max_n, help="choices per prompt (n)")
    ap.add_argument("--max-stop", type=int, default=d.max_stop, help="stop strings per request")
    ap.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars, help="characters of one stop string")
    ap.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids, help="ids in stop_token_ids")


def http_options(args: argparse.Namespace) -> tuple[AccessOptions, RequestLimits]:
    """The app's access options (the key from --api-key, else $SPECMIX_API_KEY) and request limits."""
    key = args.api_key if args.api_key is not None else os.environ.get("SPECMIX_API_KEY")
    access = AccessOptions(
        api_key=key or None,
        protect_health_metrics=args.protect_health_metrics,
        allowed_origins=tuple(args.allowed_origins),
    )
    limits = RequestLimits(
        max_body_bytes=args.max_body_bytes,
        max_prompts=args.max_prompts,
        max_n=args.max_n,
        max_stop=args.max_stop,
        max_stop_chars=args.max_stop_chars,
        max_stop_token_ids=args.max_stop_token_ids,
    )
    return access, limits


SPEC_ARGS = (
    "draft",
    "drafter",
    "no_spec",
    "k",
    "k_policy",
    "prompt_lookup",
    "tree_branches",
    "suffix_global_tokens",
    "no_draft_cut",
)  # with --target only


def _draft_kind(draft: Path | None) -> str | None:
    """The drafter a --draft directory implies: a trained head's kind, a published EAGLE-3 head's, else a draft
    model."""
    from engine.spec_decode.heads.config import is_head_dir, read_head_config
    from engine.spec_decode.heads.eagle3_formats import is_published_eagle3

    if draft is None:
        return None
    if is_head_dir(draft):
        return read_head_config(draft).kind
    return "eagle3" if is_published_eagle3(draft) else "model"


def load(args: argparse.Namespace) -> tuple[Any, str, Path | None]:
    """The engine, its served name and the target directory (for generation_config.json)."""
    from engine.api.engine import Engine
    from engine.api.options import Limits, SpeculationConfig
    from engine.core.errors import InvalidConfigError
    from engine.core.hub import resolve_model

    chunk = {} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk or None}
    limits = Limits(max_batch=args.max_batch, max_waiting=args.max_waiting, max_seq_len=args.max_seq_len, **chunk)
    if args.profile:
        given = [f"--{n.replace('_', '-')}" for n in SPEC_ARGS if n != "no_spec" and getattr(args, n) is not None]
        if given:
            raise InvalidConfigError(
                f"{', '.join(given)} invalid with --profile: the profile fixes the speculation (its build chose it; "
                "--no-spec serves its target on its plan without the drafter)"
            )
        eng = Engine.from_profile(
            args.profile, device=args.device, full_check=args.full_check, limits=limits, plain=bool(args.no_spec)
        )
        return eng, args.served_model_name or Path(args.profile).stem, Path(eng.info["target_dir"])
    hub = {"cache_dir": args.hub_cache_dir, "offline": args.offline or None}
    target = resolve_model(args.target, **hub)
    draft = resolve_model(args.draft, draft=True, **hub) if args.draft and not args.no_spec else None
    drafter = None if args.no_spec else (args.drafter or _draft_kind(draft))
    spec = (
        SpeculationConfig()  # --no-spec: the drafter's flags are not read
        if args.no_spec
        else SpeculationConfig(
            drafter=drafter,
            k=5 if args.k is None else args.k,
            k_policy=args.k_policy or "measured",
            prompt_lookup_min=args.prompt_lookup,
            tree_branches=args.tree_branches,
            suffix_global_tokens=args.suffix_global_tokens,
            draft_cut=not args.no_draft_cut,
        )
    )
    eng = Engine.from_pretrained(
        target,
        draft if drafter is not None and DRAFTERS[drafter].loads is not Loads.NOTHING else None,
        speculation=spec,
        limits=limits,
        device=args.device,
        dtype=args.dtype,
    )
    return eng, args.served_model_name or args.target, target


def _log_http(access: AccessOptions, limits: RequestLimits) -> None:
    """The access options (never the key) and the limits, at start."""
    where = " everywhere" if access.protect_health_metrics else " (not on /health, /metrics)"
    key = "required" + where if access.api_key else "none"
    log.info("API key: %s; CORS origins: %s; %s", key, ", ".join(access.allowed_origins) or "off", limits)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvicorn

        from engine.server.openai_app import OpenAIServer, create_app
    except ImportError as e:
        log.error("the server needs the serve extra: pip install -e '.[serve]' (%s)", e)
        return 2
    from engine.core.errors import EngineError

    try:
        access, limits = http_options(args)
        eng, name, target_dir = load(args)
        defaults = generation_defaults(target_dir) if args.generation_config == "auto" and target_dir else {}
    except EngineError as e:
        log.error("%s", e)
        return 2
    pol = eng.policy
    log.info(
        "model %s: target %s, draft %s, drafter %s, prompt lookup %s, K %s (policy %s), profile %s, plan %s, dtype %s",
        name,
        eng.info.get("target_dir"),
        eng.info.get("draft_dir"),
        eng.info.get("drafter"),
        eng.info.get("prompt_lookup_min") or "off",
        pol.k if pol else None,
        pol.name if pol else None,
        eng.profile.path if eng.profile else None,
        json.dumps(eng.profile.plan.to_dict())[:200] if eng.profile else None,
        eng.info.get("dtype"),
    )
    log.info("chat template: %s; generation defaults: %s", "yes" if eng.chat_template else "none", defaults or "none")
    if eng.policy is not None and eng.policy.name == "cost-model":
        log.info("K controller costs: c=%.3f", eng.costs.c)  # measured now, not in the first request
    _log_http(access, limits)
    app = create_app(OpenAIServer(eng, name, defaults, limits=limits), access)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
