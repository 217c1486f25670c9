"""The page manager: the host-side bookkeeping of which pages each sequence owns. ``manager``
(``PageManager``: sequence slots, prefix caching, committing tokens, pending device work,
inspection and persistence), ``growth`` (its mixin that reserves pages, copies shared pages on
write, forks, and builds each step's runtime metadata), ``windows`` (its mixin that releases
what left a sliding or chunked window), ``host_tier`` (its mixin that keeps evicted prefixes and
swapped-out sequences in a host-memory pool), ``group_table`` (one layer group's pool, block table and
pending copies), ``state`` (its persisted form and the one consistency checker), ``reshard`` (its
state re-split over data-parallel replicas), ``page_pool`` (free lists, reference counts and the LRU of cached pages per
data-parallel replica) and ``prefix_hash`` (the chained page digests prefix caching looks pages
up by). They are one unit because they are pure numpy and Python, deterministic on every host,
and never touch page arrays: this package imports neither ``storage`` nor ``attention``; nothing
is imported here.
"""
