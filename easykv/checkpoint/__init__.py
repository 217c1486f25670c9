"""Caches on disk and between hosts: ``checkpointer`` (``save_cache``, ``restore_cache``,
``CacheCheckpointer``, ``list_steps``), ``restore`` (restoring a step), ``format`` (the on-disk
layout and reading it back), ``reader`` (a step's page arrays read shard by shard with
tensorstore, checksummed as read), ``integrity`` (fingerprints of every persisted byte), ``record``
(the sealed JSON record and the saved manager state), ``reshard`` (what a restore may change:
the target's model and pools must be the saved ones, its format only on request), ``writer``
(the one-writer lock and write errors), ``transfer`` (one sequence's pages and page-manager
entry exported from one cache and imported into another), ``sequence_export`` and
``grouped_export`` (the two export classes) with ``export_file`` (their one base class, checks
and ``.npz`` loader), ``inspect`` (a report on a checkpoint without restoring it), and
``orbax_types`` (the names of orbax's untyped objects in annotations).

They are one unit because they sit on top of everything else, joining a cache's pages with its
manager's state, and they bring orbax, which ``import easykv`` loads only on first use. This
package never imports ``tiers`` or ``integrations``; nothing is imported here.
"""
