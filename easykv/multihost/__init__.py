"""Several JAX processes running one program: joining JAX's multi-controller runtime
(``initialize``, ``initialize_from_env``), checking that every host's page manager made the same
decisions (``assert_lockstep``, ``fingerprint``), and running a few processes on this machine that
fail fast (``launch_local``).

Its files, one concept each: ``startup.py`` (joining the runtime), ``lockstep.py`` (the lock-step
check), ``fail_fast.py`` (the opt-in exit hook that lets a failing process skip JAX's shutdown
barrier: why, how, and with which exit status) and ``launch.py`` (the local launcher).

Nothing else in easykv imports this package, but for the deprecated ``easykv.distributed``, which
re-exports it until easykv 0.3. It needs ``easykv.errors``, ``easykv.validation``, JAX, numpy and
the standard library.
"""

from easykv.multihost.launch import launch_local
from easykv.multihost.lockstep import assert_lockstep, fingerprint
from easykv.multihost.startup import initialize, initialize_from_env

__all__ = ["assert_lockstep", "fingerprint", "initialize", "initialize_from_env", "launch_local"]
