"""The wheel ships what an installed engine needs: the GPU catalog, the C++ kernel sources, console scripts."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-w", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("specmix-*.whl")
    return whl


def test_wheel_holds_the_catalog_and_the_kernel_sources(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "quant/gpus.json" in names
    csrc = {Path(n).name for n in names if n.startswith("engine/kernels/csrc/")}
    assert {"small_gemm.cpp", "amx_gemm.cpp", "decode_layers.cpp", "bindings.cpp", "decode.h"} <= csrc
    for pkg in (
        "engine/core",
        "engine/spec_decode",
        "engine/spec_decode/drafters",
        "engine/spec_decode/heads",
        "engine/kernels",
        "engine/runtime",
        "engine/server",
        "engine/train",
        "engine/api",
        "engine/build",
        "engine/demo",
        "engine/export",
        "engine/cli",
    ):
        assert f"{pkg}/__init__.py" in names, pkg
    assert not any(n.startswith(("tests/", "tools/", "profiles/")) for n in names)


def test_wheel_declares_the_console_scripts(wheel: Path) -> None:
    z = zipfile.ZipFile(wheel)
    (ep,) = [n for n in z.namelist() if n.endswith("entry_points.txt")]
    text = z.read(ep).decode()
    for script, target in (
        ("specmix-build-profile", "engine.cli.build_profile:main"),
        ("specmix-bench", "engine.cli.bench:main"),
        ("specmix-perplexity", "engine.cli.perplexity:main"),
        ("specmix-export-onnx", "engine.cli.export_onnx:main"),
    ):
        assert f"{script} = {target}" in text


def test_the_catalog_loads_from_the_package() -> None:
    from quant.catalog import load_catalog

    cat = load_catalog()
    assert {"a100-80gb", "h100-sxm", "h200", "l4", "t4"} <= set(cat["gpus"])
