"""Deprecated: this module moved to ``easykv.step.metadata``; ``import easykv.runtime`` keeps
working, with a DeprecationWarning, until easykv 0.3 (one release). The names are the moved
objects, not copies."""

import warnings

from easykv.step.metadata import (  # the public names of the module before the move (ed247fe)
    FORM_FIELDS,
    INVALID_SLOT,
    PAD_PAGE,
    PAD_POSITION,
    PAD_SLOT,
    MixedStep,
    PagedAttentionMetadata,
    array_module,
    as_mixed,
    build_mixed,
    group_runtime,
    increment_cache_lengths,
    slots_from_table,
    stack_metadata,
    step_form,
)

warnings.warn("easykv.runtime moved to easykv.step.metadata and will be removed in easykv 0.3; "
              "import from easykv.step.metadata instead", DeprecationWarning, stacklevel=2)

__all__ = ["FORM_FIELDS", "INVALID_SLOT", "MixedStep", "PAD_PAGE", "PAD_POSITION", "PAD_SLOT", "PagedAttentionMetadata",
           "array_module", "as_mixed", "build_mixed", "group_runtime", "increment_cache_lengths", "slots_from_table",
           "stack_metadata", "step_form"]
