"""torch's CPU threads for the command line: the cores free when a command starts, unless OMP_NUM_THREADS says."""

from __future__ import annotations

import os
import subprocess
import sys

from blockdraft.cli import free_cores, runnable_now

PROBE = ("import os, sys; from blockdraft.cli import app\n"
         "try:\n    app(['status', 'no-such-folder-here'])\nexcept SystemExit:\n    pass\n"
         "import torch; print('THREADS', torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])")


def test_free_cores_is_the_cores_less_the_load_at_least_one():
    assert free_cores(2, 0.3) == 2 and free_cores(2, 1.2) == 1 and free_cores(2, 7.9) == 1 and free_cores(16, 3.6) == 12


def _threads(env: dict[str, str]) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    threads, omp = out.split("THREADS")[1].split()
    return int(threads), omp


def test_a_command_sizes_torch_from_the_free_cores_and_omp_num_threads_wins():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    threads, omp = _threads(env)
    expected = free_cores(len(os.sched_getaffinity(0)), max(os.getloadavg()[0], runnable_now() - 1))
    assert threads == int(omp) and abs(int(omp) - expected) <= 1  # the load may move between here and the child's start
    assert runnable_now() >= 1  # this process, at least
    assert _threads({**env, "OMP_NUM_THREADS": "1"}) == (1, "1")
