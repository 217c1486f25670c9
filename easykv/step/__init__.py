"""One engine step's metadata: ``metadata`` holds ``PagedAttentionMetadata`` (the slot of every new
token, the page table and the lengths, and the declared proof of what its host checks found), its
validated constructors and the one conversion to the mixed form the write and attention read;
``checks`` holds the static and value checks of that metadata, each rule once, and ``HostChecked``,
the proof itself; ``loop`` runs a multi-step decode plan's steps in one device loop, each step's
metadata derived from the last. They are one unit because the manager writes this form and the storage and
attention read it, and none of them may change it under the others. This package imports ``spec``
and ``validation`` only: never ``manager``, ``storage`` or ``attention``; nothing is imported here.
"""
