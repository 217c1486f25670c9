"""The page manager: the host-side bookkeeping of which pages each sequence owns.

``manager`` holds `PageManager`, a facade over parts that own their state (each class lists what
it owns):

- ``sequences`` (`SequenceTable`: lengths, columns, floors, replicas, hashes, each row's version);
- ``group_table`` (`GroupTable`: one layer group's pool, block table and pending work) and
  ``allocators`` (one subclass per attention kind, chosen by `ALLOCATORS`; what leaves a window),
  held together by ``coordinator`` (`GroupCoordinator`, every per-group answer a tuple, `single_group`);
- ``versions`` (`VersionLog`: weight versions and prefix lookups), ``host_tier``
  (`HostTierPolicy`: swapped-out sequences, the bound `HostTier`), ``device_work`` (`PendingWork`);
- ``page_pool`` (free lists, reference counts and the LRU of cached pages per data-parallel
  replica) and ``prefix_hash`` (the chained page digests prefix caching looks pages up by).

Coordinator code handed the parts it changes: ``growth`` (reserve, copy-on-write, fork, step
metadata), ``commit``, ``rollback`` (truncate), ``admit`` (prefix hits, resume), ``decode_plan``
(multi-step decode plans); ``open_plans`` declares what each public member of `PageManager` changes
and guards the sequences of an open plan. ``state`` (the
persisted form) and ``consistency`` (the one checker, raising ``broken.Broken``) read the parts
through ``parts.ManagerParts``; ``reshard`` re-splits a state over data-parallel replicas;
``metrics`` holds the snapshots.

They are one unit because they are pure numpy and Python, deterministic on every host, and never
touch page arrays: this package imports neither ``storage`` nor ``attention`` (nor
``checkpoint`` or ``tiers``); only ``manager`` imports ``state`` and ``consistency``, which
import neither each other nor it. Nothing is imported here.
"""
