"""Deprecated: this module moved to ``easykv.multihost``; ``import easykv.distributed`` keeps
working, with a DeprecationWarning, until easykv 0.3 (one release). The names are the moved
objects, not copies."""

import warnings

from easykv.multihost import *  # noqa: F403 (the same public names as before the move)
from easykv.multihost import __all__  # noqa: F401

warnings.warn("easykv.distributed moved to easykv.multihost and will be removed in easykv 0.3; "
              "import from easykv.multihost instead", DeprecationWarning, stacklevel=2)
