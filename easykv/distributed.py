"""Multi-process helpers: start JAX's multi-controller runtime, and check hosts stay in lock-step.

Every process runs the same program. The page manager runs on every host and must make the same
decisions everywhere (it is deterministic); ``assert_lockstep`` all-gathers a fingerprint of its
state and names the processes that diverged, so a divergence is caught at the step it happens
instead of surfacing later as silently mixed-up pages.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from easykv.validation import positive_int


class LockstepError(RuntimeError):
    """Hosts that must hold identical state do not."""


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_devices_per_process: int | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout_seconds: int = 100,
    shutdown_timeout_seconds: int = 300,
) -> None:
    """``jax.distributed.initialize`` with what a CPU run needs as well.

    On TPU pods and GPU clusters the arguments may be left out (JAX detects the cluster).
    ``cpu_devices_per_process`` simulates that many CPU devices in this process and selects the
    gloo collectives, which is how the tests run several hosts on one machine. Call it before
    any other JAX work.
    """
    if cpu_devices_per_process is not None:
        cpu_devices_per_process = positive_int("cpu_devices_per_process", cpu_devices_per_process)
        jax.config.update("jax_num_cpu_devices", cpu_devices_per_process)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        shutdown_timeout_seconds=shutdown_timeout_seconds,
    )


def fingerprint(state: Mapping[str, Any]) -> bytes:
    """sha256 of a JSON-safe state in canonical form (sorted keys, no whitespace)."""
    text = json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).digest()


def assert_lockstep(manager: Any, *, what: str = "page manager") -> bytes:
    """Raise ``LockstepError`` unless every process holds the same state.

    ``manager`` is anything with ``state_dict()`` (the PageManager) or a JSON-safe mapping.
    Returns this process's fingerprint. Every process must call it at the same point.
    """
    state = manager.state_dict() if hasattr(manager, "state_dict") else manager
    if not isinstance(state, Mapping):
        raise ValueError(f"assert_lockstep needs an object with state_dict() or a mapping, got {type(manager).__name__}")
    digest = fingerprint(state)
    if jax.process_count() == 1:
        return digest
    from jax.experimental import multihost_utils

    local = np.frombuffer(digest, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(local))  # (processes, 32)
    rows = [bytes(r) for r in gathered.reshape(jax.process_count(), -1)]
    if len(set(rows)) > 1:
        groups: dict[bytes, list[int]] = {}
        for pid, row in enumerate(rows):
            groups.setdefault(row, []).append(pid)
        majority = max(groups.values(), key=lambda g: (len(g), -g[0]))
        differ = sorted(p for p in range(len(rows)) if p not in majority)
        raise LockstepError(
            f"the {what} state differs between processes: processes {differ} disagree with "
            f"processes {majority} (fingerprints "
            + ", ".join(f"{pid}:{row.hex()[:12]}" for pid, row in enumerate(rows))
            + "); every host must make the same calls in the same order"
        )
    return digest


# ---- running several processes on one machine (tests, examples, trying multi-host locally) ----
_ENV = ("EASYKV_COORDINATOR", "EASYKV_NUM_PROCESSES", "EASYKV_PROCESS_ID", "EASYKV_CPU_DEVICES")


class MultiProcessError(RuntimeError):
    """A local multi-process run failed: a worker died or the run exceeded its time bound."""


def initialize_from_env(**timeouts: int) -> int:
    """In a worker started by ``launch_local``: join the run; returns this process's id."""
    import os

    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"not started by easykv.distributed.launch_local: {missing} not set")
    pid = int(os.environ["EASYKV_PROCESS_ID"])
    initialize(
        os.environ["EASYKV_COORDINATOR"],
        int(os.environ["EASYKV_NUM_PROCESSES"]),
        pid,
        cpu_devices_per_process=int(os.environ["EASYKV_CPU_DEVICES"]),
        **timeouts,
    )
    return pid


def launch_local(
    argv: list[str],
    *,
    num_processes: int = 2,
    cpu_devices_per_process: int = 4,
    timeout: float = 180.0,
    log_dir: str,
) -> list[str]:
    """Run ``argv`` as ``num_processes`` workers on 127.0.0.1 forming one JAX runtime.

    Each worker calls ``initialize_from_env()``. Output goes to ``log_dir/process-<i>.log``.
    The first worker to fail stops the others and raises ``MultiProcessError`` with its log;
    so does a run past ``timeout`` seconds. Returns every worker's output on success.
    """
    import os
    import socket
    import subprocess
    import time

    positive_int("num_processes", num_processes)
    positive_int("cpu_devices_per_process", cpu_devices_per_process)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(log_dir, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    base.update(JAX_PLATFORMS="cpu", EASYKV_COORDINATOR=f"127.0.0.1:{port}",
                EASYKV_NUM_PROCESSES=str(num_processes), EASYKV_CPU_DEVICES=str(cpu_devices_per_process))  # fmt: skip
    paths = [os.path.join(log_dir, f"process-{i}.log") for i in range(num_processes)]
    procs = []
    try:
        for i, path in enumerate(paths):
            with open(path, "w") as out:
                env = {**base, "EASYKV_PROCESS_ID": str(i)}
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i = failed[0]
                raise MultiProcessError(
                    f"process {i} of {num_processes} exited with code {codes[i]}; the others were stopped.\n"
                    f"--- {paths[i]} (last lines) ---\n{_tail(paths[i])}"
                )
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                running = [i for i, c in enumerate(codes) if c is None]
                raise MultiProcessError(
                    f"processes {running} still running after {timeout:.0f} s; all were stopped.\n"
                    + "\n".join(f"--- {paths[i]} (last lines) ---\n{_tail(paths[i])}" for i in running)
                )
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    outputs = []
    for path in paths:
        with open(path) as f:
            outputs.append(f.read())
    return outputs


def _tail(path: str, lines: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
