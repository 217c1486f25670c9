"""One engine step's metadata: ``metadata`` (``PagedAttentionMetadata``, the slot of every new
token, the page table and the lengths; its validated constructors and the one conversion to the
mixed form) and ``checks`` (the static and value checks of that metadata, each rule once). They
are one unit because the manager writes this form and the storage and attention read it, and
none of them may change it under the others. This package imports ``spec`` and ``validation``
only: never ``manager``, ``storage`` or ``attention``; nothing is imported here.
"""
