"""The side-by-side benchmarks' check on other processes' CPU use (``benchmarks/side_by_side.py``):
busy jiffies read from ``/proc/stat``, a process's own from ``/proc/<pid>/stat`` (its name may
hold spaces and parentheses), a process tree's summed, and the share of the machine the rest
used between two samples."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))  # not a package
from side_by_side import (
    CpuSample,
    busy_jiffies,
    others_share,
    process_jiffies,
    tree_jiffies,
    tree_total,
)

PROC_STAT = "cpu  100 5 20 900 40 1 2 3 7 0\ncpu0 50 2 10 450 20 0 1 1 3 0\nintr 1 2 3\n"


def stat_line(
    pid: int, name: str, ppid: int, utime: int, stime: int, cutime: int, cstime: int
) -> str:
    fields = ["S", ppid, 1, 1, 0, -1, 4194560, 10, 0, 0, 0, utime, stime, cutime, cstime, 20, 0]
    return f"{pid} ({name}) " + " ".join(map(str, fields)) + " 1 0 100\n"


def test_busy_jiffies_counts_user_nice_system_irq_softirq_and_steal_not_idle_or_iowait():
    assert busy_jiffies(PROC_STAT) == 100 + 5 + 20 + 1 + 2 + 3


def test_busy_jiffies_refuses_text_that_does_not_start_with_the_cpu_total():
    with pytest.raises(ValueError, match="not the 'cpu' total"):
        busy_jiffies("cpu0 1 2 3 4\n")


def test_process_jiffies_reads_past_a_name_with_spaces_and_parentheses():
    line = stat_line(42, "py (worker) 1", ppid=7, utime=30, stime=12, cutime=100, cstime=5)
    assert process_jiffies(line, with_children=False) == (7, 42)
    assert process_jiffies(line, with_children=True) == (7, 147)


def test_tree_total_sums_the_root_and_its_descendants_only():
    processes = {10: (1, 5), 11: (10, 7), 12: (11, 100), 20: (1, 1000), 21: (20, 3)}
    assert tree_total(processes, 10) == 5 + 7 + 100
    assert tree_total(processes, 11) == 107
    assert tree_total(processes, 99) == 0  # gone: nothing to count


def test_others_share_is_the_machine_busy_time_this_tree_did_not_use():
    before = CpuSample(machine=1_000, own=400, seconds=10.0)
    after = CpuSample(machine=1_300, own=500, seconds=11.0)  # 2 CPUs × 100 ticks: 200 a second
    assert others_share(before, after, cpus=2) == pytest.approx(200 / 200)
    quiet = CpuSample(machine=1_110, own=500, seconds=11.0)
    assert others_share(before, quiet, cpus=2) == pytest.approx(10 / 200)


def test_others_share_stays_in_0_1_when_samples_race():
    before = CpuSample(machine=1_000, own=400, seconds=10.0)
    own_ahead = CpuSample(machine=1_050, own=500, seconds=11.0)  # own read after the machine's
    assert others_share(before, own_ahead, cpus=2) == 0.0
    assert others_share(before, before, cpus=2) == 0.0  # no time passed


def test_this_process_tree_reads_from_proc():
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs Linux /proc")
    own = process_jiffies(Path("/proc/self/stat").read_text(), with_children=True)[1]
    assert own <= tree_jiffies(os.getpid())
    sample = CpuSample.now()
    assert sample.machine >= sample.own >= 0
