"""Releasing a thread's idle OpenMP pool: its workers exit, torch starts new ones on demand,
results stay the same; LocalEngine releases its caller's pool when its worker computes with
more than one thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
import torch
from test_engine import tiny_model

from post_training_cookbook.engine import LocalEngine
from post_training_cookbook.engine import local as engine_local
from post_training_cookbook.engine.threads import release_idle_openmp_pool

# Runs in a fresh process: the count of OS threads there is the test's own.
_SCRIPT = textwrap.dedent(
    """
    import json, os, time, torch
    from post_training_cookbook.engine.threads import release_idle_openmp_pool

    def threads():
        return len(os.listdir("/proc/self/task"))

    def threads_once_settled(target):
        # Released workers exit on their own schedule: on a loaded machine, after the call.
        deadline = time.monotonic() + 10.0
        while threads() != target and time.monotonic() < deadline:
            time.sleep(0.01)
        return threads()

    torch.set_num_threads(2)
    x = torch.randn(512, 512)
    alone = threads()
    first = (x @ x).sum().item()  # a parallel op: the main thread's pool starts
    with_pool = threads()
    released = release_idle_openmp_pool()
    after_release = threads_once_settled(alone)
    second = (x @ x).sum().item()  # torch starts a pool again
    print(json.dumps({
        "alone": alone, "with_pool": with_pool, "released": released,
        "after_release": after_release, "again": threads(), "same": first == second,
    }))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_release_lets_the_idle_workers_exit_and_torch_starts_them_again() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    if not seen["released"]:
        pytest.skip("this torch build does not use GNU libgomp")
    assert seen["with_pool"] > seen["alone"]  # the pool's worker
    assert seen["after_release"] == seen["alone"]
    assert seen["again"] == seen["with_pool"]
    assert seen["same"]


def test_release_is_harmless_without_a_pool() -> None:
    assert release_idle_openmp_pool() in (True, False)  # by build; must not raise
    x = torch.randn(64, 64, dtype=torch.float64)
    # parallel ops still compute right afterwards: checked against numpy's own product
    torch.testing.assert_close(x @ x, torch.from_numpy(x.numpy() @ x.numpy()))


def test_engine_releases_its_callers_pool_only_when_it_computes_with_more_threads(
    monkeypatch: pytest.MonkeyPatch, torch_threads: Callable[[int], None]
) -> None:
    model = tiny_model()
    calls: list[int] = []
    monkeypatch.setattr(engine_local, "release_idle_openmp_pool", lambda: calls.append(1))
    torch_threads(2)
    LocalEngine(model, num_threads=1).shutdown()
    assert calls == []  # a 1-thread worker has no pool: the caller's spins alone
    LocalEngine(model, num_threads=2).shutdown()
    assert calls == [1]


def test_an_idle_engine_asked_to_release_memory_releases_its_own_pool(
    monkeypatch: pytest.MonkeyPatch, torch_threads: Callable[[int], None]
) -> None:
    """A lockstep trainer asks the idle engine to release memory before it steps: the
    worker's idle pool goes too, or its threads beside the trainer's would make the process
    hold more OpenMP threads than cores (SmolLM2's shape: train phase 11.3 -> 15.0 s)."""
    import threading
    import time

    model = tiny_model()
    callers: list[str] = []
    monkeypatch.setattr(
        engine_local,
        "release_idle_openmp_pool",
        lambda: callers.append(threading.current_thread().name),
    )
    torch_threads(2)
    engine = LocalEngine(model, num_threads=2)
    try:
        assert callers == [threading.current_thread().name]  # the constructor: the caller's
        engine.release_memory()
        deadline = time.monotonic() + 10.0
        while len(callers) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(callers) == 2 and callers[1] != threading.current_thread().name
    finally:
        engine.shutdown()
