"""The engine builds its model on a thread of its own: the caller's thread keeps no OpenMP team after the build
(engine/api/build_thread.py), so the worker thread's rounds run on the only team in the process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.api.build_thread import build_off_thread

ROOT = Path(__file__).resolve().parents[1]

# In a fresh process (this one's threads and its one-thread OpenMP setting would blur the count): the process's
# threads before and after Engine.from_pretrained, then after a generate in this thread (which runs parallel
# regions here, so a team appears: the count can move). The build's thread and its team finish exiting after
# join() returns (libgomp frees the team in the thread's exit handlers), so the count is read once they are gone,
# or after 30 s; a team kept by the caller's thread never goes.
COUNT = """
import os, sys, time
from engine import Engine, SamplingParams
n = lambda: len(os.listdir("/proc/self/task"))
before = n()
eng = Engine.from_pretrained(sys.argv[1])
deadline = time.monotonic() + 30
while n() > before and time.monotonic() < deadline:
    time.sleep(0.02)
after = n()
eng.generate(["The cat"], SamplingParams(max_new_tokens=4))
print(before, after, n())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenMP keeps no team with one core")
def test_the_build_leaves_no_openmp_team_in_the_callers_thread(tiny_demo):
    target, _ = tiny_demo
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    r = subprocess.run(
        [sys.executable, "-c", COUNT, str(target)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    before, after, after_generate = map(int, r.stdout.split()[-3:])
    assert after == before  # the build's thread ended, and its team with it
    assert after_generate > after  # the probe sees a team: a generate in this thread makes one


def test_the_build_returns_its_result_and_raises_its_exception_here():
    import threading

    import torch

    cpu = torch.device("cpu")
    assert build_off_thread(lambda: threading.current_thread().name, cpu) == "specmix-build"
    assert build_off_thread(lambda: threading.current_thread().name, torch.device("meta")) == (
        threading.current_thread().name
    )

    def fail() -> None:
        raise KeyError("the build's own error")

    with pytest.raises(KeyError, match="the build's own error"):
        build_off_thread(fail, cpu)
