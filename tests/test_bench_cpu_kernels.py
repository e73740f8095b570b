"""tools/bench_cpu_kernels.py: every storage timed on a small shape, and bad arguments refused in one line."""

from __future__ import annotations

import pytest

from engine.cli.bench_cpu_kernels import STORAGES, main, storages
from engine.kernels.cpu_gemm import cpu_kernels, small_gemm_status

STATUS = small_gemm_status()


@pytest.mark.skipif(STATUS is not None, reason=f"CPU kernels unavailable: {STATUS}")
def test_table_has_every_storage_and_row_count(capsys):
    assert main(["--shapes", "40x96", "--rows", "1,5", "--stream-mib", "1", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    names = storages(cpu_kernels())  # the AMX tiles' columns where this CPU runs them
    assert set(STORAGES) <= set(names) and lines[0].split("|")[3:-1] == [f" {s} " for s in names]
    body = [ln for ln in lines[2:] if ln.startswith("| [40, 96]")]
    assert [ln.split("|")[2].strip() for ln in body] == ["1", "5"]
    for ln in body:  # fp32's own ratio is 1.00x; every cell has a time, a rate and a ratio
        cells = [c.strip() for c in ln.split("|")[3:-1]]
        assert len(cells) == len(names) and cells[0].endswith("1.00x")
        assert all(c.count(",") == 2 and c.endswith("x") for c in cells)


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--rows", "0"], "--rows"),
        (["--rows", "513"], "--rows"),
        (["--rows", "a"], "--rows"),
        (["--shapes", "12"], "--shapes"),
        (["--shapes", "0x5"], "--shapes"),
        (["--threads", "0"], "--threads"),
        (["--repeats", "101"], "--repeats"),
        (["--stream-mib", "x"], "--stream-mib"),
    ],
)
def test_bad_arguments_exit_2_naming_the_field(argv, field, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bench_cpu_kernels:") and field in err
