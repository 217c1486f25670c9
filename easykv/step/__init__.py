"""One engine step's metadata, in one form inside: ``ragged`` holds `RaggedStep` (the slot of every
new token, the page table and the lengths, and the declared proof of what its host checks found),
the page manager's builder of it and the next-decode-step rule; ``metadata`` is the edge, EasyDeL's
``PagedAttentionMetadata`` (its prefill, decode and mixed forms, validated constructors, JSON) and
the one conversion of those forms to a `RaggedStep`, run where a step enters a write or attention;
``checks`` holds the static and value checks of a step, each rule once, and ``HostChecked``, the
proof itself; ``loop`` runs a multi-step decode plan's steps in one device loop, each step derived
from the last. They are one unit because the manager writes this form and the storage and attention
read it, and none of them may change it under the others. This package imports ``spec`` and
``validation`` only: never ``manager``, ``storage`` or ``attention``; nothing is imported here.
"""
