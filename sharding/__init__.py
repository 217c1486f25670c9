"""Deprecated: this package moved to ``easykv.sharding``; ``import sharding`` keeps working, with a
DeprecationWarning, until easykv 0.3 (one release). A top-level name this generic may belong to
another project, so easykv no longer owns it after that."""

import sys
import warnings

from easykv.sharding import *  # noqa: F403 (the same public names as before the move)
from easykv.sharding import __all__  # noqa: F401
from easykv.sharding import axes as _axes
from easykv.sharding import manager as _manager
from easykv.sharding import mesh as _mesh

warnings.warn("the top-level package 'sharding' moved to 'easykv.sharding' and will be removed in easykv 0.3; "
              "import from easykv.sharding instead", DeprecationWarning, stacklevel=2)
# `from sharding.mesh import create_mesh` and `sharding.mesh.create_mesh` as before: the
# submodules are the moved ones, not copies.
axes, manager, mesh = _axes, _manager, _mesh
for _name, _module in (("axes", _axes), ("manager", _manager), ("mesh", _mesh)):
    sys.modules[f"{__name__}.{_name}"] = _module
del _name, _module
