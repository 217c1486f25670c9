"""Deprecated: this module moved to ``easykv.multihost``; ``import easykv.distributed`` keeps
working, with a DeprecationWarning, until easykv 0.3 (one release). The names are the moved
objects, not copies: every name the module offered before the move (9af7079), the two
exceptions it raised included (their home is ``easykv.errors`` now)."""

import warnings

from easykv.errors import LockstepError, MultiProcessError
from easykv.multihost import *  # noqa: F403 (the same public names as before the move)
from easykv.multihost import __all__ as _launcher_names

__all__ = [*_launcher_names, "LockstepError", "MultiProcessError"]

warnings.warn("easykv.distributed moved to easykv.multihost and will be removed in easykv 0.3; "
              "import from easykv.multihost instead", DeprecationWarning, stacklevel=2)
