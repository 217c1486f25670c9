"""The page manager: the host-side bookkeeping of which pages each sequence owns. ``manager``
(``PageManager``: sequence slots, prefix caching, committing tokens, pending device work,
inspection and persistence), ``growth`` (its mixin that reserves pages, copies shared pages on
write, forks, and builds each step's runtime metadata), ``state`` (its persisted form and the one
consistency checker), ``page_pool`` (free lists, reference counts and the LRU of cached pages per
data-parallel replica) and ``prefix_hash`` (the chained page digests prefix caching looks pages
up by). They are one unit because they are pure numpy and Python, deterministic on every host,
and never touch page arrays: this package imports neither ``storage`` nor ``attention``; nothing
is imported here.
"""
