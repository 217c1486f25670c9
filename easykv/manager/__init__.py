"""The page manager: the host-side bookkeeping of which pages each sequence owns.

``manager`` holds `PageManager`, a facade over parts that own their state (each class lists what
it owns, and each changes only through its own methods: no module writes into another object's
fields, which tests/manager/test_parts_own_state.py checks over the package's AST):

- ``sequences`` (`SequenceTable`: lengths, columns, floors, replicas, hashes, each row's version);
- ``group_table`` (`GroupTable`: one layer group's pool, block table and pending work, and the
  window rule of its kind) and ``allocators`` (one subclass per attention kind, chosen by
  `ALLOCATORS`: what leaves a window), held together by ``coordinator`` (`GroupCoordinator`, every
  per-group answer a tuple, `single_group`);
- ``versions`` (`VersionLog`: weight versions and prefix lookups), ``device_work``
  (`CopyCounter`, and the `DeviceWork` a plan carries);
- ``lower_tier`` (`LowerTier`: the one interface of a tier below the device pool, which the core
  asks through `LowerTiers`; the `TierWork` a tier hands over), and the host-memory tier, the
  first such layer: ``host_tier`` (`HostTierLayer`: swapped-out sequences, the bound `HostTier`)
  over one ``host_group_tier`` per layer group (`HostGroupTier`: its host pool and pending
  transfers);
- ``page_pool`` (free lists, reference counts and the LRU of cached pages per data-parallel
  replica) and ``prefix_hash`` (the chained page digests prefix caching looks pages up by, and
  `SequenceHashes`, what each sequence knows of its content).

Coordinator code handed the parts it changes (through their methods): ``growth`` (reserve,
copy-on-write, fork, step metadata), ``commit``, ``rollback`` (truncate), ``admit`` (prefix hits,
resume), ``step_plan`` (the frozen plan of a step, its commit and abort); ``open_plans`` declares
what each public member of `PageManager` changes and guards the sequences of an open plan.
``state`` (the persisted form) and ``consistency`` (the one checker, with ``group_checks``,
raising ``broken.Broken``) read the parts through ``parts.ManagerParts``; ``reshard`` re-splits a
state over data-parallel replicas; ``metrics`` holds the snapshots.

They are one unit because they are pure numpy and Python, deterministic on every host, and never
touch page arrays: this package imports neither ``storage`` nor ``attention`` (nor
``checkpoint`` or ``tiers``); only ``manager`` imports ``state`` and ``consistency``, which
import neither each other nor it. Nothing is imported here.
"""
