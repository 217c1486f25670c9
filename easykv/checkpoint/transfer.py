"""Moving one sequence between caches: a prefill host hands a sequence to a decode host.

    exported = export_sequence(cache, manager, seq_id, token_ids=prompt)   # host numpy arrays
    exported.save("seq.npz"); exported = SequenceExport.load("seq.npz")    # across hosts
    cache, new_id = import_sequence(other_cache, other_manager, exported)

A cache of several layer groups exports a `GroupedSequenceExport` instead: one part per group,
each in the group's own geometry and from the group's own window, imported into a cache of the
same groups (windows there may be narrower).

The export holds the sequence's K/V token-major, ``(layers, length - first_position, kv_heads,
head_dim)`` (a windowed cache exports only what its window still reads), either dense in the
source's logical dtype (``dequantize=True``) or raw (quantized values in their value dtype plus
compact scales, per token and head: independent of the page layout). The importing
cache may have another mesh, page size, pool size or batch size; the manager there allocates
the pages (reusing cached prefix pages when the token ids are known) and one jitted, donating
write fills them. A raw export imported into a cache with the same quantizer is bit-exact;
otherwise the values are dequantized and re-encoded by the target (cast to its dtype).

Token ids: the PageManager keeps digests, not token ids, so pass ``token_ids=`` to
`export_sequence` (or give the manager a ``token_ids(seq_id)`` method). Without them the
import commits the tokens without ids (no prefix caching for that sequence).

An export is input like any other: a `SequenceExport` checks every field when it is built
(also by `load`, from a file that may have been crafted; the classes live in
`easykv.checkpoint.sequence_export` and `grouped_export`, their file format in `export_file`),
and `import_sequence` checks the export, the cache, the manager and its own arguments before it
changes anything. A failed call leaves the manager
(``state_dict()`` equal), the cache (not donated) and the export as they were.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from easykv.checkpoint.export_file import TOKEN_HINT, check_raw_exportable
from easykv.checkpoint.grouped_export import ExportedGroup, GroupedSequenceExport
from easykv.checkpoint.sequence_export import SequenceExport
from easykv.errors import CacheFullError, InvariantError
from easykv.manager.manager import PageManager
from easykv.manager.prefix_hash import salt_digest
from easykv.manager.step_plan import StepPlan
from easykv.quantization import QuantizedPages, is_compressing
from easykv.runner import Runner
from easykv.spec.metadata import PagedAttentionCacheMetaData, known_dtype
from easykv.storage.cache import PagedAttentionCache
from easykv.storage.pages import StoredPages, encode_tokens, from_storage, read_pages, to_storage
from easykv.storage.placement import group_layouts
from easykv.storage.pool_match import check_cache_of
from easykv.storage.writes import scatter_encoded  # the encoded-token scatter every write uses
from easykv.validation import INT32_MAX, boolean, integer, integer_array, show

if TYPE_CHECKING:
    from easykv.tiers.host import HostTier


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _tokens_major(x: jax.Array) -> jax.Array:
    """(layers, heads, n, page_size, *tail) -> (layers, n * page_size, heads, *tail)."""
    perm = (0, 2, 3, 1) + tuple(range(4, x.ndim))
    y = jnp.transpose(x, perm)
    return y.reshape((y.shape[0], -1) + y.shape[3:])


@partial(jax.jit, static_argnames=("group", "dequantize"))
def _gather_group(cache: PagedAttentionCache, ids: jax.Array, group: int, dequantize: bool) -> Any:
    """Pages ``ids`` of layer group ``group``'s stacks, token-major ``(layers_in_group,
    len(ids) * page_size, heads, dim)`` (values None for a latent group): dequantized into the
    group's dtype, or a quantized group's raw codes and scales. Reads only those pages."""
    meta = cache.metadata
    dtype = known_dtype(meta.group_dtype(meta.groups[group]))

    def read(pages: Any) -> Any:
        if pages is None:
            return None
        if isinstance(pages, QuantizedPages) and not dequantize:
            value_dtype = pages.quantizer.value_shape(2)[1]
            return {"values": _tokens_major(from_storage(jnp.take(pages.values, ids, axis=2), value_dtype)),
                    "scales": _tokens_major(jnp.take(pages.scales, ids, axis=2))}
        layers = jax.tree.leaves(pages)[0].shape[0]
        return _tokens_major(jnp.stack([read_pages(pages, ids, dtype, i) for i in range(layers)]))

    return read(cache.key_pages[group]), read(cache.value_pages[group])


def _check_pair(cache: Any, manager: Any) -> Any:
    """The cache's metadata, once ``cache`` is a PagedAttentionCache and ``manager`` the live
    PageManager of its pool (`PageManager.check_cache`); ValueError otherwise."""
    if not isinstance(cache, PagedAttentionCache):
        raise ValueError(f"cache must be a PagedAttentionCache, got {type(cache).__name__}")
    if not isinstance(manager, PageManager):
        raise ValueError(f"manager must be the easykv.PageManager of the cache's pool, got {type(manager).__name__}")
    return check_cache_of(cache, manager.metadata)


def _manager_token_ids(manager: Any, seq_id: int) -> Any:
    fn = getattr(manager, "token_ids", None)
    return fn(seq_id) if callable(fn) else None


def export_sequence(cache: PagedAttentionCache, manager: PageManager, seq_id: int, *,
                    token_ids: ArrayLike | None = None, dequantize: bool = True
                    ) -> SequenceExport | GroupedSequenceExport:
    """Sequence ``seq_id``'s committed tokens (``manager.length``) read from ``cache`` into host
    arrays; only its pages are read. In a sliding or chunked cache the export holds the K/V its
    window still reads (from ``manager.first_kept_position``; ``first_position`` of the
    export). A cache of several layer groups (other geometries or windows) gives a
    `GroupedSequenceExport`: each group's part in its own geometry, from its own window.
    Reads only: the cache and the manager are unchanged. The manager's pending copies and
    scrubs of the sequence's pages must have been applied
    (``runner.apply_pending()``, or ``easykv.apply_pending(manager, cache)``).

    Args:
      cache: the `PagedAttentionCache` holding the sequence.
      manager: the cache's `PageManager`.
      seq_id: a claimed sequence with committed tokens, not swapped out.
      token_ids: its committed tokens' ids, ``(length,)`` ints, kept with the export for the
        importer's prefix cache; None (default): ``manager.token_ids(seq_id)`` where the
        manager has that method, else none.
      dequantize: dense K/V in the cache's logical dtype (default True); False keeps a quantized
        cache's values and scales as stored (bit-exact into a cache with the same quantizer).

    Returns:
      a `SequenceExport` (K/V token-major, dense ones ``(layers, length - first_position,
      kv_heads, head_dim)``), or a `GroupedSequenceExport` for a cache of several layer groups.
    """
    meta = _check_pair(cache, manager)
    dequantize = boolean("dequantize", dequantize)
    seq = integer("seq_id", seq_id, lo=0, hi=meta.batch_size - 1,
                  hint=f"a sequence id of this manager, batch_size={meta.batch_size}")
    length = manager.length(seq)  # UnknownSequenceError when not claimed
    if length == 0:
        raise ValueError(f"sequence {seq} has no committed tokens to export; commit them first (manager.step)")
    if manager.has_host_tier and seq in manager.swapped_ids:
        raise ValueError(f"sequence {seq} is swapped out to the host tier; swap_in({seq}) and apply the work "
                         "(runner.apply_pending()) before exporting it")
    if token_ids is None:
        token_ids = _manager_token_ids(manager, seq)
    if token_ids is not None:
        token_ids = integer_array("token_ids", token_ids, ndim=1, lo=0, hi=INT32_MAX, hint=TOKEN_HINT)
        if token_ids.shape != (length,):
            raise ValueError(f"token_ids must be {length} integer ids (the sequence's committed tokens), got "
                             f"{token_ids.size} ids")
    ps = meta.page_size
    raw = not dequantize and any(is_compressing(meta.group_quantizer(g)) for g in meta.groups)
    for g in meta.groups if raw else ():
        check_raw_exportable(meta.group_quantizer(g), "export_sequence(dequantize=False)")
    held = [_held_pages(manager, meta, seq, length, g) for g in range(len(meta.groups))]
    if meta.is_single_geometry:  # every layer in one geometry: the format every easykv reads
        first, ids = held[0]
        # one group of every layer, in model order
        keys, values = jax.device_get(_gather_group(cache, jnp.asarray(_padded_ids(ids)), 0, dequantize=not raw))
        cut = _cutter(first, length, ps)
        return SequenceExport(length=length, num_hidden_layers=meta.num_hidden_layers,
                              num_kv_heads=meta.num_kv_heads, kv_head_dim_size=meta.kv_head_dim_size,
                              dtype=meta.dtype, quantization=meta.quantization, raw=raw,
                              keys=jax.tree.map(cut, keys), values=jax.tree.map(cut, values),
                              token_ids=token_ids, source_page_size=ps, first_position=first)
    groups = []
    for g, (group, (first, ids)) in enumerate(zip(meta.groups, held)):
        keys, values = jax.device_get(_gather_group(cache, jnp.asarray(_padded_ids(ids)), g, dequantize=not raw))
        cut = _cutter(first, length, ps)
        groups.append(ExportedGroup(layers=group.layers, num_kv_heads=group.num_kv_heads,
                                    key_head_dim=group.key_head_dim, value_head_dim=group.value_head_dim,
                                    latent=group.latent, first_position=first, keys=jax.tree.map(cut, keys),
                                    values=None if values is None else jax.tree.map(cut, values),
                                    dtype=group.dtype, quantization=group.quantization))
    return GroupedSequenceExport(length=length, groups=tuple(groups), dtype=meta.dtype,
                                 quantization=meta.quantization, raw=raw, token_ids=token_ids, source_page_size=ps)


def _held_pages(manager: PageManager, meta: Any, seq: int, length: int, g: int) -> tuple[int, np.ndarray]:
    """(first position held, page ids from its page on) of ``seq`` in layer group ``g``, once
    no pending copy or scrub still has to reach them."""
    ps = meta.page_size
    group = None if len(meta.groups) == 1 else g
    first = manager.sequence(seq).first_kept[g]
    skip = first // ps  # pages released from the window, or never held by a resumed sequence
    ids = np.asarray(manager.pages(seq, group=group), np.int64)[skip: -(-length // ps)]
    pool = meta.groups[g].num_pages
    if (skip + ids.size) * ps < length or np.any((ids < 0) | (ids >= pool)):
        raise InvariantError(f"sequence {seq} holds pages {ids.tolist()} that cannot hold its {length} tokens in a "
                             f"pool of {pool} pages")
    if manager.has_pending_work:  # what would the work write? (asked of a copy: taking it is a change)
        pending = set(manager.clone().take_work().written_pages(g).tolist())
        late = [p for p in ids.tolist() if p in pending]
        if late:
            raise ValueError(f"sequence {seq}'s page {late[0]} has a pending copy-on-write copy, onload or scrub, so "
                             "the cache does not hold its tokens yet; apply it first: runner.apply_pending() (or "
                             "cache, _ = easykv.apply_pending(manager, cache, host=...))")
    return first, ids


def _padded_ids(ids: np.ndarray) -> np.ndarray:
    padded = np.zeros(_pow2(ids.size), np.int32)  # few shapes for jit; page 0 is a valid filler
    padded[: ids.size] = ids
    return padded


def _cutter(first: int, length: int, ps: int) -> Any:
    """Token-major rows read from ``first``'s page on -> the rows of positions first .. length - 1."""
    skip = first // ps
    return lambda a: np.ascontiguousarray(np.asarray(a)[:, first - skip * ps: length - skip * ps])


@partial(jax.jit, donate_argnums=0)
def _write_raw(cache: PagedAttentionCache, parts: tuple[tuple[Any, Any], ...],
               slots: tuple[jax.Array, ...]) -> PagedAttentionCache:
    """A sequence's rows per layer group ``(layers_in_group, tokens, heads, ...)`` (values None
    for a latent group), written at the group's ``slots`` into its stacks: one scatter per array.
    A group's rows are its raw codes and scales (a dict), or dense values in its dtype, encoded
    as its pages store them."""
    keys, values = list(cache.key_pages), list(cache.value_pages)
    for g, (group_layout, (k, v)) in enumerate(zip(group_layouts(cache.metadata, cache.layout), parts)):
        pages, new = [keys[g]], [_as_pages(k, keys[g])]
        if v is not None:
            pages.append(cast(StoredPages, values[g]))  # rows given: the group stores values
            new.append(_as_pages(v, values[g]))
        out = scatter_encoded(pages, new, slots[g], layout=group_layout)
        keys[g] = out[0]
        if v is not None:
            values[g] = out[1]
    return PagedAttentionCache(cache.metadata, tuple(keys), tuple(values), cache.layout)


def _as_pages(part: Any, like: Any) -> Any:
    if not isinstance(part, dict):
        return encode_tokens(jnp.asarray(part), like)
    return QuantizedPages(to_storage(part["values"], like.values.dtype), part["scales"], like.quantizer)


def _checked_export(exported: Any) -> SequenceExport | GroupedSequenceExport:
    """``exported`` checked again, as a new export: its fields may have been changed
    (``object.__setattr__``, arrays reshaped in place) since it was built."""
    kind = type(exported)
    if kind not in (SequenceExport, GroupedSequenceExport):
        raise ValueError(f"exported must be a SequenceExport or GroupedSequenceExport (from export_sequence or "
                         f"SequenceExport.load), got {kind.__name__}")
    try:
        fields = {f.name: getattr(exported, f.name) for f in dataclasses.fields(kind)}
        if kind is GroupedSequenceExport and isinstance(fields["groups"], (tuple, list)):
            fields["groups"] = tuple(
                ExportedGroup(**{f.name: getattr(g, f.name) for f in dataclasses.fields(ExportedGroup)})
                if isinstance(g, ExportedGroup) else g for g in fields["groups"])
    except AttributeError as err:
        raise ValueError(f"exported is an incomplete {kind.__name__} ({err})") from None
    rebuilt: SequenceExport | GroupedSequenceExport = kind(**fields)
    return rebuilt


def _export_groups(exported: SequenceExport | GroupedSequenceExport) -> list[tuple[tuple[Any, ...], int]]:
    """Per layer group of the export: (geometry, first position held)."""
    if isinstance(exported, GroupedSequenceExport):
        return [(g.geometry(), g.first_position) for g in exported.groups]
    d = exported.kv_head_dim_size
    return [((tuple(range(exported.num_hidden_layers)), exported.num_kv_heads, d, d, False), exported.first_position)]


def _check_import(meta: Any, exported: SequenceExport | GroupedSequenceExport) -> list[int]:
    """Per layer group of the target, the first position it keeps for the sequence (its
    window's start; 0 for full attention), once the export fits the target: the same model
    (each group's layers, kv heads, K and V dims), and each group's export reaching back at
    least as far as the target group's window."""
    if isinstance(exported, SequenceExport) and meta.is_single_geometry:
        fields = ("num_hidden_layers", "num_kv_heads", "kv_head_dim_size")
        diff = [f"{f}: export {getattr(exported, f)}, cache {getattr(meta, f)}"
                for f in fields if getattr(exported, f) != getattr(meta, f)]
        if diff:
            raise ValueError("the sequence comes from a model of another shape (" + "; ".join(diff) + "); import "
                             "it into a cache of the same model")
    theirs = _export_groups(exported)
    mine = [(g.layers, g.num_kv_heads, g.key_head_dim, g.value_head_dim, g.latent) for g in meta.groups]
    if meta.is_single_geometry:
        mine = [(mine[0][0],) + (meta.num_kv_heads, meta.kv_head_dim_size, meta.kv_head_dim_size, False)]
    names = ("layers", "kv heads", "K dim", "V dim", "latent")
    if [geo for geo, _ in theirs] != mine:
        def show_groups(groups: list[tuple[Any, ...]]) -> str:
            return "; ".join(", ".join(f"{n} {show(list(v) if isinstance(v, tuple) else v)}"
                                       for n, v in zip(names, geo))
                             for geo in groups)

        raise ValueError(f"the sequence comes from a model of another shape "
                         f"(export: {show_groups([geo for geo, _ in theirs])}"
                         f" | cache: {show_groups(mine)}); import it into a cache of the same model")
    if exported.length > meta.max_sequences:
        raise ValueError(f"the sequence holds {exported.length} tokens but the target cache allows at most "
                         f"max_sequences={meta.max_sequences}")
    needed = []
    for g, (group, (_, first)) in enumerate(zip(meta.groups, theirs)):
        need = int(group.first_needed_position(exported.length))
        if first > need:
            reach = ("reads every position" if not group.windowed
                     else f"({group.attention}, window {group.window}) reads from position {need}")
            where = "the target cache" if len(meta.groups) == 1 else f"layer group {g} of the target cache"
            raise ValueError(f"the export holds positions {first}..{exported.length - 1} only (it comes "
                             f"from a sliding or chunked cache), but {where} {reach} at length "
                             f"{exported.length}; import it into a cache with the same or a narrower window")
        needed.append(need)
    return needed


def _available_per_replica(manager: PageManager, meta: Any) -> np.ndarray:
    """Pages each data-parallel replica can hand out now (free or evictable) in each layer
    group, ``(groups, replicas)``: its slice minus the pages running sequences hold (a page is
    in use exactly while a sequence holds it)."""
    grouped = len(meta.groups) > 1
    if meta.page_shards == 1:
        return np.array([[g.free_pages + g.cached_pages] for g in manager.metrics.groups], np.int64)
    ids = manager.active_ids
    out = []
    for g, group in enumerate(meta.groups):
        per = group.num_pages // meta.page_shards
        table = manager.page_table(ids, group=g if grouped else None) if ids else np.zeros((0, 1), np.int32)
        held = np.unique(table[table >= 0])
        out.append(per - np.bincount(held // per, minlength=meta.page_shards).astype(np.int64))
    return np.stack(out)


def _room(manager: PageManager, meta: PagedAttentionCacheMetaData, length: int, tokens: np.ndarray | None, salt: Any,
          skip: int) -> bool:
    """Raise CacheFullError when no replica has, in every layer group, the pages the sequence
    needs beyond its cached prefix. Returns True when every replica surely has them (whatever
    the prefix match shares); False when only the manager itself can tell (then it is asked on
    a copy). ``skip``: leading pages the sequence never holds (a resumed window)."""
    ps = meta.page_size
    total = -(-length // ps) - skip
    matched = manager.cached_prefix_length(tokens, salt=salt) // ps if tokens is not None else 0
    need = total - matched
    avail = _available_per_replica(manager, meta).min(axis=0)  # the tightest group of each replica
    best = int(avail.max())
    if need > best:
        split = meta.page_shards > 1
        raise CacheFullError(
            f"importing a sequence of {length} tokens needs {need} new pages"
            f"{' in one data-parallel replica' if split else ''}{' of every layer group' * (len(meta.groups) > 1)} "
            f"({matched} of its {total} pages are cached) but only {best} are free or evictable"
            f"{' in the emptiest replica' if split else ''}; release or preempt sequences first", resource="pages",
            needed=need, available=best, replica=int(avail.argmax()) if split else None)
    return total <= int(avail.min())


def _admit(manager: PageManager, seq_id: int | None, tokens: np.ndarray | None, salt: Any,
           length: int, start: int) -> tuple[int, int, int, StepPlan]:
    """Claim, match the cached prefix (or resume at ``start``, a page boundary), schedule the
    write: (seq, the position writing starts at, tokens to write, the step's plan). On any failure
    the claimed id is released again."""
    if seq_id is None:
        [seq] = manager.claim(1)
    else:
        manager.external_claim([seq_id])
        seq = seq_id
    try:
        if start:
            manager.resume(seq, start)
            done = start
        else:
            done = manager.match_prefix(seq, tokens, salt=salt) if tokens is not None else 0
        n = length - done
        plan = manager.schedule([seq], [n], pad_tokens_to=_pow2(n))
    except BaseException:
        manager.release(seq)
        raise
    return seq, done, n, plan


def _per_layer(meta: Any, spans: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """Per-group rows -> what ``cache.write`` takes: one array of every layer's rows (one group
    of every layer) or, per model layer, its rows (None for a latent layer's values)."""
    if len(meta.groups) == 1:
        return spans[0]
    keys, values = [None] * meta.num_hidden_layers, [None] * meta.num_hidden_layers
    for group, (k, v) in zip(meta.groups, spans):
        for j, layer in enumerate(group.layers):
            keys[layer] = k[j]
            values[layer] = None if v is None else v[j]
    return keys, values


def import_sequence(cache: PagedAttentionCache, manager: PageManager,
                    exported: SequenceExport | GroupedSequenceExport, *, seq_id: int | None = None,
                    salt: str | bytes | int | None = None, reuse_prefix: bool = True, host: HostTier | None = None
                    ) -> tuple[PagedAttentionCache, int]:
    """Give ``exported`` a sequence id in ``manager``, pages in ``cache``, and write its K/V.
    With token ids and ``reuse_prefix``, pages already cached for the same prefix (same
    ``salt``) are shared instead of written; the written pages enter the prefix cache under
    ``salt`` (with ``reuse_prefix=False`` and a salt they stay out of it). The manager's pending
    copy-on-write copies and scrubs are applied first (they must precede any write); with a
    host-memory tier, so are its transfers, through ``host``.

    Into a sliding or chunked cache, the sequence gets pages only from its window's first page
    on (`PageManager.resume`): it never holds more than its window, however long it is. An
    export from such a cache (``first_position`` > 0) imports into any cache whose window
    reads no further back. A sequence that lacks its early tokens in either way is neither
    matched against nor entered in the prefix cache (its keys need every token).

    Everything is checked before anything changes: on ValueError (bad export, arguments, or a
    manager that is not the cache's) or CacheFullError (no sequence slot, or too few pages in
    the pool or in the data-parallel replica the sequence would live in), the manager is as
    before (``state_dict()`` equal) and the cache is neither donated nor written.

    Args:
      cache: the target `PagedAttentionCache`; donated, like ``cache.write``'s.
      manager: the target cache's `PageManager`.
      exported: a `SequenceExport` or `GroupedSequenceExport` (`export_sequence`, or
        ``SequenceExport.load``), checked again here.
      seq_id: a free sequence id to claim; None (default): the lowest free one.
      salt: the prefix namespace the pages are matched and cached under (a str, bytes or
        64-bit int; None: the default).
      reuse_prefix: share pages already cached for the export's token ids (default True).
      host: the cache's `HostTier`, required when the manager has a host-memory tier; else None.

    Returns:
      ``(cache, seq_id)``: the written cache and the sequence's id.
    """
    meta, exported, needed, reuse_prefix, seq_id, runner = _checked_import(cache, manager, exported, seq_id, salt,
                                                                           reuse_prefix, host)
    # A sliding or chunked target keeps the pages from its window's first page on: the sequence
    # resumes there. It, or an export holding only a window, lacks the early tokens that prefix
    # keys are made of: such a sequence is neither matched nor entered in the prefix cache.
    windowed = all(g.windowed for g in meta.groups)
    start = min(needed) // meta.page_size * meta.page_size if windowed else 0
    whole = start == 0 and exported.first_position == 0
    tokens = exported.token_ids if whole else None
    match = tokens if (tokens is not None and reuse_prefix) else None
    # Without the prefix match, written pages would be keyed under no salt: commit their ids
    # only when that is the namespace asked for.
    commit_ids = tokens is not None and (reuse_prefix or salt is None)
    exact, parts, firsts = _rows_to_write(meta, exported)
    if not _room(manager, meta, exported.length, match, salt, start // meta.page_size):
        # Only the manager knows whether the pages its prefix match shares leave room in that
        # replica; ask it on a copy so that a refusal leaves the real one untouched (a release
        # after match_prefix would not restore its counters and LRU order).
        _admit(manager.clone(), seq_id, match, salt, exported.length, start)
    # Checked: from here on nothing fails for a reason the caller could have avoided.
    seq, done, n, plan = _admit(manager, seq_id, match, salt, exported.length, start)
    spans = _spans(parts, firsts, done, n)

    def write(target: PagedAttentionCache, planned: StepPlan) -> tuple[PagedAttentionCache, None]:
        return _write_rows(target, meta, spans, exact, planned.metadata, seq, n), None

    try:  # the plan's work, the write, the commit (ids known: its full pages enter the prefix cache)
        runner.run(plan, write, token_ids=[tokens[done:]] if tokens is not None and commit_ids else None)
    except BaseException:
        manager.release(seq)  # the runner aborted the plan: the sequence holds nothing of its own
        raise
    return runner.cache, seq


def _checked_import(cache: Any, manager: Any, exported: Any, seq_id: Any, salt: Any, reuse_prefix: Any,
                    host: Any) -> tuple[Any, SequenceExport | GroupedSequenceExport, list[int], bool, int | None,
                                    Runner]:
    """`import_sequence`'s arguments checked, nothing changed: (the cache's metadata, the export
    checked again, each group's first needed position (`_check_import`), ``reuse_prefix``,
    ``seq_id``, the runner that will write it)."""
    meta = _check_pair(cache, manager)
    if manager.has_host_tier and host is None:
        raise ValueError("this manager has a host-memory tier: pass its HostTier (import_sequence(..., host=tier)); "
                         "the import's pages may bring prefixes back from it or push others to it")
    exported = _checked_export(exported)
    needed = _check_import(meta, exported)
    reuse_prefix = boolean("reuse_prefix", reuse_prefix)
    salt_digest(salt)  # ValueError for a salt the prefix cache cannot key
    if seq_id is not None:
        seq_id = integer("seq_id", seq_id, lo=0, hi=meta.batch_size - 1,
                         hint=f"a free sequence id of this manager, batch_size={meta.batch_size}, or None")
        if manager.contains(seq_id):
            raise ValueError(f"seq_id {seq_id} is already claimed; release it first, pick a free id or pass "
                             "seq_id=None")
    elif not manager.slots_remaining:
        raise CacheFullError(f"importing a sequence needs a free sequence slot but all batch_size={meta.batch_size} "
                             "are claimed; release finished sequences first", resource="sequence slots", needed=1,
                             available=0)
    # Last, the tier (its check binds it): before the admission changes prefix counters and LRU order.
    return meta, exported, needed, reuse_prefix, seq_id, Runner(manager, cache, host=host)


def _rows_to_write(meta: Any, exported: SequenceExport | GroupedSequenceExport
                   ) -> tuple[list[bool], list[tuple[Any, Any]], list[int]]:
    """Per layer group: whether its raw codes go in as they are, its (keys, values or None)
    rows, the first position they hold. A group's raw codes where the target group has the same
    quantizer (bit-exact), else dense rows in the target group's dtype."""
    formats = meta.group_formats
    if isinstance(exported, GroupedSequenceExport):
        exact = [exported.group_raw(i) and exported.group_format(i)[1].name == formats[i][1]
                 for i in range(len(exported.groups))]
        dense = exported.dense() if not all(exact) else []
        parts = [(g.keys, g.values) if ok else dense[i] for i, (g, ok) in enumerate(zip(exported.groups, exact))]
        firsts = [g.first_position for g in exported.groups]
    else:
        exact = [exported.raw and exported.quantization == formats[0][1]]
        parts = [(exported.keys, exported.values) if exact[0] else exported.dense()]
        firsts = [exported.first_position]
    parts = [(k, v) if ok else (np.asarray(k).astype(dt), None if v is None else np.asarray(v).astype(dt))
             for (k, v), ok, (dt, _) in zip(parts, exact, formats)]
    return exact, parts, firsts


def _spans(parts: list[tuple[Any, Any]], firsts: list[int], done: int, n: int) -> list[tuple[Any, Any]]:
    """Each group's rows of positions ``done .. done + n - 1`` (what the import writes), padded
    to the write's token count. A group's rows start at its first position: those before it lie
    before the target group's window (checked), and zeros fill them."""
    pad = _pow2(n) - n

    def spanner(first: int) -> Any:
        lead, skip = max(first - done, 0), max(done - first, 0)

        def span(a: np.ndarray) -> np.ndarray:
            a = np.asarray(a)[:, skip:]
            return np.pad(a, [(0, 0), (lead, pad)] + [(0, 0)] * (a.ndim - 2)) if lead or pad else a

        return span

    return [(jax.tree.map(spanner(f), k), None if v is None else jax.tree.map(spanner(f), v))
            for (k, v), f in zip(parts, firsts)]


def _write_rows(cache: PagedAttentionCache, meta: Any, spans: list[tuple[Any, Any]], exact: list[bool],
                step_meta: Any, seq: int, n: int) -> PagedAttentionCache:
    """The spans written into the pages the step metadata gives the sequence (the cache is
    donated): raw codes as they are when any group keeps them, else through ``cache.write``."""
    if any(exact):
        slots = tuple(jnp.asarray(step_meta.slot_mapping, jnp.int32) for step_meta in step_meta)
        written: PagedAttentionCache = _write_raw(cache, tuple(spans), slots)
        return written
    keys, values = _per_layer(meta, spans)
    cache, dropped = cache.write(keys, values, step_meta)
    if int(dropped):
        raise InvariantError(f"import_sequence dropped {int(dropped)} of {n} tokens of sequence {seq}",
                             where="import_sequence")
    return cache


__all__ = ["SequenceExport", "export_sequence", "import_sequence"]
