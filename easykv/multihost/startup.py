"""Joining JAX's multi-controller runtime: ``initialize`` on any cluster (or CPU processes on one
machine), ``initialize_from_env`` in a worker that ``launch_local`` started. Named ``startup``
rather than ``initialize`` so that the package's ``initialize`` (the function) does not hide a
module of the same name."""

from __future__ import annotations

import os

import jax

from easykv.multihost.fail_fast import install_fail_fast
from easykv.validation import boolean, positive_int

# What launch_local puts in each worker's environment and initialize_from_env reads.
JOIN_ENV = ("EASYKV_COORDINATOR", "EASYKV_NUM_PROCESSES", "EASYKV_PROCESS_ID", "EASYKV_CPU_DEVICES")
FAIL_FAST_ENV = "EASYKV_FAIL_FAST"  # "1": the launcher asks its workers to fail fast


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_devices_per_process: int | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout_seconds: int = 100,
    shutdown_timeout_seconds: int = 300,
    fail_fast: bool = False,
) -> None:
    """``jax.distributed.initialize`` with what a CPU run needs as well.

    On TPU pods and GPU clusters the arguments may be left out (JAX detects the cluster). Call it
    before any other JAX work.

    Args:
      coordinator_address: ``ip:port`` where process 0 runs the coordinator service; None only
        where JAX detects the cluster.
      num_processes: processes in the run (None: detected).
      process_id: this process's id, ``0 .. num_processes - 1`` (None: detected).
      cpu_devices_per_process: simulate that many CPU devices in this process (>= 1) and select
        the gloo collectives, which is how the tests run several hosts on one machine; None
        (default): leave JAX's devices as they are.
      initialization_timeout: seconds the connection is retried before initialization fails
        (default 300).
      heartbeat_timeout_seconds: seconds without a heartbeat after which a process counts as dead
        (default 100).
      shutdown_timeout_seconds: seconds a terminating process waits for the others to terminate
        (default 300).
      fail_fast: make a failing exit of this process end it at once, skipping JAX's shutdown
        barrier, and replace ``sys.exit`` with a wrapper that records the status
        (``easykv.multihost.fail_fast`` says why, and with which exit status); off (default)
        unless asked.
    """
    if boolean("fail_fast", fail_fast):
        install_fail_fast()  # first: a failure inside jax.distributed.initialize is covered too
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


def initialize_from_env(*, fail_fast: bool | None = None, **timeouts: int) -> int:
    """In a worker started by ``launch_local``: join the run; returns this process's id.

    RuntimeError when the launcher's environment variables are missing.

    Args:
      fail_fast: None (default) does what the launcher asks in ``EASYKV_FAIL_FAST`` ("1": on,
        which ``launch_local`` always sets, so a failing worker ends at once and the launcher
        hears of it; "0" or unset: off); True or False decides here.
      **timeouts: `initialize`'s ``initialization_timeout``, ``heartbeat_timeout_seconds`` and
        ``shutdown_timeout_seconds``, in seconds.
    """
    missing = [k for k in JOIN_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"not started by easykv.multihost.launch_local: {missing} not set")
    if fail_fast is None:
        asked = os.environ.get(FAIL_FAST_ENV, "0")
        if asked not in ("0", "1"):
            raise ValueError(f"${FAIL_FAST_ENV} must be 0 or 1, got {asked!r}")
        fail_fast = asked == "1"
    coordinator, num_processes, pid, cpu_devices = (os.environ[k] for k in JOIN_ENV)
    initialize(coordinator, int(num_processes), int(pid), cpu_devices_per_process=int(cpu_devices),
               fail_fast=fail_fast, **timeouts)  # fmt: skip
    return int(pid)
