"""Names for orbax's objects (and etils', its paths) in this package's annotations.

Neither library ships type information (no ``py.typed``; ``pyproject.toml`` lets mypy skip their
imports), so to a type checker each of their objects is ``Any`` whatever an annotation names.
These aliases say which object is meant and make that ``Any`` explicit: mypy's
``disallow_any_unimported`` refuses an annotation that is ``Any`` silently.
"""

from __future__ import annotations

import os
from typing import Any, TypeAlias

#: ``etils.epath.Path``: a checkpoint directory or a file in it (local, or on an object store).
EPath: TypeAlias = Any
#: A checkpoint directory as a caller names it: a str, an ``os.PathLike``, or an epath (object stores).
CheckpointDir: TypeAlias = str | os.PathLike[str] | EPath
#: ``orbax.checkpoint.CheckpointManager`` over a checkpoint directory (``format.orbax_manager``).
OrbaxManager: TypeAlias = Any
#: ``orbax.checkpoint.PyTreeCheckpointHandler``, the handler of the pages.
OrbaxPyTreeHandler: TypeAlias = Any

__all__ = ["CheckpointDir", "EPath", "OrbaxManager", "OrbaxPyTreeHandler"]
