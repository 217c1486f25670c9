"""Attacks on export_sequence / import_sequence / SequenceExport: every malformed input is refused
with its precise exception (ValueError naming the bad value, CacheFullError, UnknownSequenceError)
and changes nothing: the manager's ``state_dict()`` is equal, the cache is neither donated nor
written. Crafted .npz files (header fields, arrays, zip container, byte flips) are refused or load
exactly what was saved."""

from __future__ import annotations

import copy
import io
import json
import pickle
import warnings
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from easykv import PagedAttentionCache, PagedAttentionCacheMetaData
from easykv.checkpoint.transfer import SequenceExport, export_sequence, import_sequence
from easykv.errors import CacheFullError, FileRefusedError, UnknownSequenceError
from easykv.manager.manager import PageManager
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning
from tests.support.checkpoints import engine_run, new_qcache, qsetup, raw_leaves
from tests.support.pools import HEAD_DIM, LAYERS, mesh_for

BF16 = np.dtype(jnp.bfloat16)
HEADS = 8  # the "heads" and "dp" layouts
HUGE = (2**64 - 5, 2**200)


# ---- valid exports, built directly (no device work) ----------------------------------------------
def dense_export(length: int = 9, tokens: bool = True, heads: int = HEADS, layers: int = LAYERS,
                 head_dim: int = HEAD_DIM, seed: int = 0) -> SequenceExport:
    rng = np.random.default_rng(seed)
    shape = (layers, length, heads, head_dim)
    return SequenceExport(length=length, num_hidden_layers=layers, num_kv_heads=heads, kv_head_dim_size=head_dim,
                          dtype="bfloat16", quantization="none", raw=False,
                          keys=rng.standard_normal(shape).astype(BF16), values=rng.standard_normal(shape).astype(BF16),
                          token_ids=np.arange(100, 100 + length) if tokens else None, source_page_size=4)


def raw_export(length: int = 5, quantization: str = "int8", heads: int = HEADS, layers: int = LAYERS,
               head_dim: int = HEAD_DIM) -> SequenceExport:
    rng = np.random.default_rng(1)
    from easykv.quantization import get_quantizer

    q = get_quantizer(quantization)
    tail, vdtype = q.value_shape(head_dim)
    base = (layers, length, heads)

    def part() -> dict[str, np.ndarray]:
        values = rng.integers(-127, 128, base + tuple(tail)).astype(np.int8).view(vdtype) if vdtype.itemsize == 1 \
            else rng.integers(0, 255, base + tuple(tail)).astype(vdtype)
        return {"values": values, "scales": rng.random(base + q.scale_shape(head_dim)).astype(np.float32)}

    return SequenceExport(length=length, num_hidden_layers=layers, num_kv_heads=heads, kv_head_dim_size=head_dim,
                          dtype="bfloat16", quantization=quantization, raw=True, keys=part(), values=part(),
                          token_ids=list(range(length)), source_page_size=8)


def crafted(base: SequenceExport, **changes) -> SequenceExport:
    """``base`` with fields changed behind the constructor's back (as a caller could)."""
    obj = copy.copy(base)
    for name, value in changes.items():
        object.__setattr__(obj, name, value)
    return obj


# ---- the state that must not change -----------------------------------------------------------------
def snapshot(cache: PagedAttentionCache, manager: PageManager) -> tuple:
    return manager.state_dict(), raw_leaves(cache)


def assert_untouched(cache: PagedAttentionCache, manager: PageManager, snap: tuple) -> None:
    state, bits = snap
    assert manager.state_dict() == state
    leaves = jax.tree.leaves(cache)
    assert not any(leaf.is_deleted() for leaf in leaves), "the cache was donated"
    assert all(np.array_equal(a, b) for a, b in zip(bits, raw_leaves(cache), strict=True))


@pytest.fixture(scope="module")
def live():
    """A cache and manager mid-run (live sequences, a fork, cached pages) that every attack
    targets; each attack checks that it left them exactly as they were."""
    cache, manager, _ = engine_run("heads")
    return cache, manager


def raises(expected: type, match: str, fn, *args, **kwargs) -> BaseException:
    with pytest.raises(expected, match=match) as info:
        fn(*args, **kwargs)
    assert type(info.value) is expected, f"{type(info.value).__name__}: {info.value}"
    return info.value


# ---- fields of a SequenceExport, each broken in each way -------------------------------------------------
def _arr(shape, dtype=BF16):
    return np.zeros(shape, dtype)


FULL = (LAYERS, 9, HEADS, HEAD_DIM)
FIELD_ATTACKS = [
    *[("length", v, "length") for v in (True, 9.0, "9", None, 0, -1, *HUGE, np.float32(9), [9])],
    ("length", 8, "keys has shape"), ("length", 10, "keys has shape"),
    *[("num_hidden_layers", v, "num_hidden_layers") for v in (True, 2.0, 0, -2, *HUGE, "2", None)],
    ("num_hidden_layers", 3, "keys has shape"),
    *[("num_kv_heads", v, "num_kv_heads") for v in (False, 8.0, 0, -8, *HUGE, "8")],
    ("num_kv_heads", 4, "keys has shape"),
    *[("kv_head_dim_size", v, "kv_head_dim_size") for v in (True, 8.0, 0, -8, *HUGE, b"8")],
    ("kv_head_dim_size", 16, "keys has shape"),
    *[("dtype", v, "dtype") for v in ("int8", "float64", "uint16", None, 3, [1], object, "no-such-dtype", "f4,f4",
                                       np.dtype("V2"), np.dtype(">f4"), b"bfloat16")],
    ("dtype", "float32", "keys has dtype"), ("dtype", "float16", "keys has dtype"),
    *[("quantization", v, "quantization") for v in (None, 3, True, b"none", "int9", "int4-g0", "int4-g3",
                                                     "int4-g" + "9" * 5000, "")],
    *[("raw", v, "raw") for v in (1, 0, "yes", None, np.int8(0), True)],
    *[("keys", v, "keys") for v in (None, 5, "abc", [[1.0]], {"values": 1}, _arr(FULL, np.float32),
                                     _arr(FULL, np.uint16), _arr(FULL[:3]), _arr(FULL + (1,)), _arr((2, 8, 8, 8)),
                                     _arr((2, 10, 8, 8)), np.zeros(FULL, object), _arr(FULL, np.float16))],
    *[("values", v, "values") for v in (None, _arr(FULL, np.float32), _arr((2, 9, 4, 8)), jnp.zeros(FULL[:2]))],
    *[("token_ids", v, "token_ids") for v in (list(range(8)), list(range(10)), [], np.arange(9.0), [0.5] * 9,
                                               [-1] + [0] * 8, [2**31] + [0] * 8, [2**64 - 5] + [0] * 8,
                                               [2**200] + [0] * 8, np.full(9, 2**64 - 5, np.uint64),
                                               np.ones(9, bool), "abcdefghi", np.zeros((3, 3), int), {"a": 1},
                                               [[1], [2, 3]], [True] * 9, 7)],
    *[("source_page_size", v, "source_page_size") for v in (0, -4, True, 4.0, "4", *HUGE, [4])],
]
RAW_ATTACKS = [  # against a raw int8 export: (field, value builder, match)
    ("keys", lambda e: {"values": e.keys["values"]}, "keys"),
    ("keys", lambda e: {**e.keys, "extra": e.keys["scales"]}, "keys"),
    ("keys", lambda e: e.keys["values"], "keys"),
    ("keys", lambda e: {"values": e.keys["values"], "scales": e.keys["scales"].astype(np.float16)}, "scales"),
    ("keys", lambda e: {"values": e.keys["values"], "scales": e.keys["scales"][..., None]}, "scales"),
    ("keys", lambda e: {"values": e.keys["values"].view(np.uint8), "scales": e.keys["scales"]}, "values"),
    ("keys", lambda e: {"values": e.keys["values"][:, :4], "scales": e.keys["scales"]}, "values"),
    ("values", lambda e: {"values": None, "scales": e.values["scales"]}, "values"),
    ("raw", lambda e: False, "keys must be a numpy array"),
    ("quantization", lambda e: "fp8", "dtype int8"),
    ("quantization", lambda e: "int4", "values'.. has shape|values'\\] has"),
    ("quantization", lambda e: "none", "raw=True needs a compressing quantizer"),
]


def _field_cases():
    for i, (field, value, match) in enumerate(FIELD_ATTACKS):
        yield pytest.param(dense_export, field, (lambda e, v=value: v), match, id=f"dense-{field}-{i}")
    for i, (field, build, match) in enumerate(RAW_ATTACKS):
        yield pytest.param(raw_export, field, build, match, id=f"raw-{field}-{i}")


FIELD_CASES = list(_field_cases())


def _kwargs(export: SequenceExport) -> dict:
    return {f: getattr(export, f) for f in ("length", "num_hidden_layers", "num_kv_heads", "kv_head_dim_size",
                                           "dtype", "quantization", "raw", "keys", "values", "token_ids",
                                           "source_page_size")}


@pytest.mark.parametrize("make, field, build, match", FIELD_CASES)
def test_sequence_export_refuses_each_bad_field(make, field, build, match):
    base = make()
    kwargs = {**_kwargs(base), field: build(base)}
    raises(ValueError, match, SequenceExport, **kwargs)


@pytest.mark.parametrize("make, field, build, match", FIELD_CASES)
def test_import_of_a_crafted_export_changes_nothing(live, make, field, build, match):
    cache, manager = live
    base = make()
    bad = crafted(base, **{field: build(base)})
    snap = snapshot(cache, manager)
    raises(ValueError, match, import_sequence, cache, manager, bad)
    assert_untouched(cache, manager, snap)


# ---- import_sequence: its other arguments, the cache/manager pairing, capacity -------------------------------
def _other_pool_manager():
    return PageManager(qsetup("heads", pages=8)[2])


def _deleted_cache():
    cache = new_qcache("heads")
    for leaf in jax.tree.leaves(cache):
        leaf.delete()
    return cache


IMPORT_ATTACKS = [  # (id, kwargs builder(cache, manager), exception, match)
    ("exported-dict", lambda c, m: dict(exported={"keys": 1}), ValueError, "SequenceExport"),
    ("exported-none", lambda c, m: dict(exported=None), ValueError, "SequenceExport"),
    ("exported-bytes", lambda c, m: dict(exported=dense_export().to_bytes()), ValueError, "SequenceExport"),
    ("exported-deleted-field", lambda c, m: dict(exported=_without_field(dense_export(), "raw")), ValueError,
     "incomplete"),
    ("other-heads", lambda c, m: dict(exported=dense_export(heads=4)), ValueError, "num_kv_heads"),
    ("other-layers", lambda c, m: dict(exported=dense_export(layers=3)), ValueError, "num_hidden_layers"),
    ("other-head-dim", lambda c, m: dict(exported=dense_export(head_dim=16)), ValueError, "kv_head_dim_size"),
    ("too-long", lambda c, m: dict(exported=dense_export(length=17)), ValueError, "max_sequences"),
    *[(f"seq-id-{i}", (lambda c, m, v=v: dict(seq_id=v)), ValueError, "seq_id")
      for i, v in enumerate((True, 1.0, "1", -1, 4, *HUGE, [1], np.float64(1)))],
    ("seq-id-claimed", lambda c, m: dict(seq_id=0), ValueError, "already claimed"),
    *[(f"salt-{i}", (lambda c, m, v=v: dict(salt=v)), ValueError, "salt")
      for i, v in enumerate((1.5, True, [1], {"a": 1}, 2**200, object()))],
    *[(f"reuse-prefix-{i}", (lambda c, m, v=v: dict(reuse_prefix=v)), ValueError, "reuse_prefix")
      for i, v in enumerate((1, None, "yes", np.int8(1)))],
    ("cache-none", lambda c, m: dict(cache=None), ValueError, "PagedAttentionCache"),
    ("cache-view", lambda c, m: dict(cache=c.views[0]), ValueError, "PagedAttentionCache"),
    ("cache-deleted", lambda c, m: dict(cache=_deleted_cache()), ValueError, "donated"),
    ("manager-none", lambda c, m: dict(manager=None), ValueError, "PageManager"),
    ("manager-metadata", lambda c, m: dict(manager=c.metadata), ValueError, "PageManager"),
    ("manager-dict", lambda c, m: dict(manager=m.state_dict()), ValueError, "PageManager"),
    ("manager-other-pool", lambda c, m: dict(manager=_other_pool_manager()), ValueError, "num_pages_per_layer"),
    ("manager-swapped", lambda c, m: dict(cache=m, manager=c), ValueError, "PagedAttentionCache"),
]


def _without_field(export: SequenceExport, name: str) -> SequenceExport:
    obj = copy.copy(export)
    object.__delattr__(obj, name)
    return obj


@pytest.mark.parametrize("build, expected, match", [pytest.param(*a[1:], id=a[0]) for a in IMPORT_ATTACKS])
def test_bad_import_arguments_change_nothing(live, build, expected, match):
    cache, manager = live
    kwargs = {"cache": cache, "manager": manager, "exported": dense_export(), **build(cache, manager)}
    snap = snapshot(cache, manager)
    raises(expected, match, import_sequence, kwargs.pop("cache"), kwargs.pop("manager"), kwargs.pop("exported"),
           **kwargs)
    assert_untouched(cache, manager, snap)


def test_no_free_slot_is_cache_full_and_changes_nothing():
    cache, manager = new_qcache("heads", pages=8), _other_pool_manager()
    manager.claim(4)
    snap = snapshot(cache, manager)
    err = raises(CacheFullError, "sequence slot", import_sequence, cache, manager, dense_export())
    assert err.resource == "sequence slots"
    assert_untouched(cache, manager, snap)


def _meta(layout: str, pages: int, max_len: int) -> PagedAttentionCacheMetaData:
    paxis = PartitionAxis(page_axis="dp") if layout == "dp" else PartitionAxis()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        return PagedAttentionCacheMetaData.create(mesh_for(layout), 4, LAYERS, max_len, 4, HEADS, HEAD_DIM, 0.9,
                                                  "bfloat16", partition_manager=PartitionManager(paxis),
                                                  num_pages_per_layer=pages)


def _cache(layout: str, meta: PagedAttentionCacheMetaData) -> PagedAttentionCache:
    paxis = PartitionAxis(page_axis="dp") if layout == "dp" else PartitionAxis()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        return PagedAttentionCache.init_cache(mesh_for(layout), meta.dtype, meta, PartitionManager(paxis))


def _commit(manager: PageManager, tokens: list[int], *, release: bool) -> int:
    [seq] = manager.claim(1)
    manager.commit(manager.schedule([seq], [len(tokens)]), [tokens])
    if release:
        manager.release(seq)
    return seq


PREFIX = list(range(500, 508))  # two full pages of 4 tokens


def _prefixed_export(length: int) -> SequenceExport:
    export = dense_export(length=length)
    return SequenceExport(**{**_kwargs(export), "token_ids": PREFIX + list(range(900, 900 + length - 8))})


def test_prefix_match_that_leaves_too_few_pages_changes_nothing():
    """One replica of 8 pages: the prefix's 2 pages are cached (evictable), the 6 others held.
    The import's prefix match would take those 2 cached pages, leaving none for its third
    page: CacheFullError, and the prefix cache (LRU order) and counters are as before."""
    meta = _meta("heads", 8, 16)
    cache, manager = _cache("heads", meta), PageManager(meta)
    _commit(manager, PREFIX, release=True)
    _commit(manager, list(range(16)), release=False)  # pages 2..5
    _commit(manager, list(range(30, 38)), release=False)  # pages 6, 7
    snap = snapshot(cache, manager)
    raises(CacheFullError, "needs 1 page", import_sequence, cache, manager, _prefixed_export(9))
    assert_untouched(cache, manager, snap)
    # Without the shared prefix the import needs 3 pages of 2: refused before anything.
    raises(CacheFullError, "needs 3 new pages", import_sequence, cache, manager, _prefixed_export(9),
           reuse_prefix=False)
    assert_untouched(cache, manager, snap)


def test_prefix_match_in_a_full_replica_changes_nothing_and_a_free_one_is_used():
    """Two data-parallel replicas of 12 pages: replica 0 holds the cached prefix and nothing
    else free, replica 1 is empty. The import's prefix binds it to replica 0, where its third
    page does not fit (the pool as a whole has 12 free pages): CacheFullError and no change.
    Without a matching prefix the same sequence goes to replica 1."""
    meta = _meta("dp", 24, 48)
    cache, manager = _cache("dp", meta), PageManager(meta)
    _commit(manager, PREFIX, release=True)  # pages 0, 1 of replica 0, cached
    _commit(manager, list(range(40)), release=False)  # pages 2..11: replica 0 now has only the cached 2
    assert manager.metrics.free_pages == 12
    snap = snapshot(cache, manager)
    err = raises(CacheFullError, "replica 0", import_sequence, cache, manager, _prefixed_export(9))
    assert err.replica == 0
    assert_untouched(cache, manager, snap)
    cache, seq = import_sequence(cache, manager, dense_export(length=9, tokens=False))
    assert manager.sequence(seq).replica == 1 and manager.length(seq) == 9
    manager.check_invariants()


def test_prefix_match_of_running_pages_fits_where_the_pool_total_seemed_short():
    """The prefix pages are held by a running sequence (sharing them costs nothing): 2 free
    pages are enough for a 3-page sequence. The import shares the prefix and writes one page."""
    meta = _meta("heads", 8, 16)
    cache, manager = _cache("heads", meta), PageManager(meta)
    owner = _commit(manager, PREFIX, release=False)
    _commit(manager, list(range(16)), release=False)  # pages 2..5; 6, 7 free
    exported = _prefixed_export(9)
    cache, seq = import_sequence(cache, manager, exported)
    assert manager.pages(seq)[:2] == manager.pages(owner)[:2] and manager.length(seq) == 9
    assert manager.metrics.prefix_hits == 1
    manager.check_invariants()
    got = export_sequence(cache, manager, seq, token_ids=exported.token_ids)
    # Only the page it wrote holds its K/V; the shared prefix pages hold the owner's (zeros here).
    assert np.array_equal(got.keys[:, 8:].view(np.uint16), exported.keys[:, 8:].view(np.uint16))


# ---- export_sequence ------------------------------------------------------------------------------------
EXPORT_ATTACKS = [  # (id, kwargs builder(cache, manager), exception, match)
    *[(f"seq-id-{i}", (lambda c, m, v=v: dict(seq_id=v)), ValueError, "seq_id")
      for i, v in enumerate((True, 0.0, "0", -1, 4, *HUGE, None, [0]))],
    ("seq-id-released", lambda c, m: dict(seq_id=3), UnknownSequenceError, "not claimed"),
    *[(f"token-ids-{i}", (lambda c, m, v=v: dict(token_ids=v)), ValueError, "token_ids")
      for i, v in enumerate(([1, 2], list(range(12)), np.arange(11.0), [-1] * 11, [2**31] * 11, [2**64 - 5] * 11,
                             [2**200] * 11, "abcdefghijk", np.zeros((11, 1), int), np.ones(11, bool), {"a": 1},
                             [[1]] * 11, 5, [0] * 10 + [0.5]))],
    *[(f"dequantize-{i}", (lambda c, m, v=v: dict(dequantize=v)), ValueError, "dequantize")
      for i, v in enumerate((1, None, "no", np.int8(0)))],
    ("cache-none", lambda c, m: dict(cache=None), ValueError, "PagedAttentionCache"),
    ("cache-deleted", lambda c, m: dict(cache=_deleted_cache()), ValueError, "donated"),
    ("manager-none", lambda c, m: dict(manager=None), ValueError, "PageManager"),
    ("manager-other-pool", lambda c, m: dict(manager=_other_pool_manager()), ValueError, "num_pages_per_layer"),
    ("manager-swapped", lambda c, m: dict(cache=m, manager=c), ValueError, "PagedAttentionCache"),
]


@pytest.mark.parametrize("build, expected, match", [pytest.param(*a[1:], id=a[0]) for a in EXPORT_ATTACKS])
def test_bad_export_arguments_change_nothing(live, build, expected, match):
    cache, manager = live
    kwargs = {"cache": cache, "manager": manager, "seq_id": 0, "token_ids": list(range(manager.length(0))),
              **build(cache, manager)}
    snap = snapshot(cache, manager)
    raises(expected, match, export_sequence, kwargs.pop("cache"), kwargs.pop("manager"), kwargs.pop("seq_id"),
           **kwargs)
    assert_untouched(cache, manager, snap)


def test_export_of_an_empty_sequence_is_refused():
    cache, manager = new_qcache("heads", pages=8), _other_pool_manager()
    [seq] = manager.claim(1)
    snap = snapshot(cache, manager)
    raises(ValueError, "no committed tokens", export_sequence, cache, manager, seq)
    assert_untouched(cache, manager, snap)


# ---- files: the header, the arrays, the container ------------------------------------------------------------
def members_of(export: SequenceExport) -> tuple[dict, dict[str, np.ndarray]]:
    with np.load(io.BytesIO(export.to_bytes())) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(arrays.pop("header").tobytes()), arrays


def npz(members: dict[str, object]) -> bytes:
    """A zip of ``name -> ndarray (as .npy) or bytes``, as given (names as they are)."""
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # duplicate names
        with zipfile.ZipFile(buf, "w") as zf:
            for name, data in members:
                if isinstance(data, np.ndarray):
                    out = io.BytesIO()
                    np.lib.format.write_array(out, data, allow_pickle=True)
                    data = out.getvalue()
                zf.writestr(name, data)
    return buf.getvalue()


def file_with(export: SequenceExport, *, header: dict | None = None, drop: tuple = (), arrays: dict | None = None,
              header_bytes: bytes | None = None, extra: list | None = None) -> bytes:
    head, arrs = members_of(export)
    head = {k: v for k, v in {**head, **(header or {})}.items() if k not in drop}
    arrs = {k: v for k, v in {**arrs, **(arrays or {})}.items() if k not in drop}
    text = header_bytes if header_bytes is not None else json.dumps(head).encode()
    members = [("header.npy", np.frombuffer(text, np.uint8))] + [(f"{k}.npy", v) for k, v in arrs.items()]
    return npz(members + (extra or []))


def _npy_with_header(header: str, data: bytes = b"") -> bytes:
    text = header.encode("latin1")
    pad = 64 - (10 + len(text) + 1) % 64
    body = text + b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body + data


D = dense_export
HEADER_ATTACKS = [  # (id, header changes, match)
    *[(f"{field}-{i}", {field: v}, field)
      for field in ("length", "num_hidden_layers", "num_kv_heads", "kv_head_dim_size")
      for i, v in enumerate((True, 2.5, "3", -1, 0, *HUGE, None, [3], {"a": 1}))],
    *[(f"source_page_size-{i}", {"source_page_size": v}, "source_page_size")
      for i, v in enumerate((True, 4.0, "4", -1, 0, *HUGE, [4]))],
    *[(f"dtype-{i}", {"dtype": v}, "dtype") for i, v in enumerate((3, "int8", "float64", "nope", None, ["bfloat16"],
                                                                  "float32"))],
    *[(f"quantization-{i}", {"quantization": v}, "quantization") for i, v in enumerate((3, None, "int9", "int4-g0",
                                                                                       ["none"]))],
    *[(f"raw-{i}", {"raw": v}, "raw") for i, v in enumerate((1, "true", None, True))],
    *[(f"format-{i}", {"format": v}, "format") for i, v in enumerate(("easykv.SequenceExport/2", 1, None, ""))],
    *[(f"dtypes-{i}", {"dtypes": v}, "dtypes") for i, v in enumerate((
        {}, "x", None, {"keys.dense": "float32", "values.dense": "float32"},
        {"keys.dense": "bfloat16", "values.dense": "bfloat16", "token_ids": "int32"},
        {"keys.values": "int8", "keys.scales": "float32", "values.values": "int8", "values.scales": "float32"}))],
    ("unknown-entry", {"extra": 1}, "unknown entries"),
    ("length-mismatch", {"length": 8}, "implies"),
    ("heads-mismatch", {"num_kv_heads": 4}, "implies"),
]


def _file_cases():
    for case_id, changes, match in HEADER_ATTACKS:
        yield pytest.param(lambda c=changes: file_with(D(), header=c), match, id=f"header-{case_id}")
    for field in ("format", "length", "num_hidden_layers", "num_kv_heads", "kv_head_dim_size", "dtype",
                  "quantization", "raw", "source_page_size", "dtypes"):
        yield pytest.param(lambda f=field: file_with(D(), drop=(f,)), "lacks|format", id=f"header-missing-{field}")
    base = json.dumps(members_of(D())[0])
    texts = {
        "nan": base.replace('"length": 9', '"length": NaN'),
        "infinity": base.replace('"length": 9', '"length": Infinity'),
        "neg-infinity": base.replace('"raw": false', '"raw": -Infinity'),
        "nested-40": base[:-1] + ', "extra": ' + "[" * 40 + "]" * 40 + "}",
        "nested-5000": base[:-1] + ', "extra": ' + "[" * 5000 + "]" * 5000 + "}",
        "nested-20000": base[:-1] + ', "extra": ' + "[" * 20000 + "]" * 20000 + "}",
        "list": "[1, 2]", "number": "3", "string": '"easykv"', "empty": "", "truncated": base[:-5],
        "duplicate-keys": base[:-1] + ', "length": 2**3}',
    }
    for name, text in texts.items():
        yield pytest.param(lambda t=text: file_with(D(), header_bytes=t.encode()), "header", id=f"header-text-{name}")
    yield pytest.param(lambda: file_with(D(), header_bytes=b"\xff\xfe{}"), "header", id="header-not-utf8")
    yield pytest.param(lambda: file_with(D(), header_bytes=b" " * 70000), "header", id="header-too-big")
    head, arrs = members_of(D())
    good = {f"{k}.npy": v for k, v in arrs.items()}
    header_arr = np.frombuffer(json.dumps(head).encode(), np.uint8)
    member_attacks = {
        "header-int32": [("header.npy", header_arr.astype(np.int32)), *good.items()],
        "header-2d": [("header.npy", header_arr[None]), *good.items()],
        "header-missing": list(good.items()),
        "header-not-npy": [("header", header_arr.tobytes()), *good.items()],
        "keys-missing": [("header.npy", header_arr), ("values.dense.npy", good["values.dense.npy"])],
        "extra-member": [("header.npy", header_arr), *good.items(), ("evil.npy", np.zeros(3))],
        "extra-plain-file": [("header.npy", header_arr), *good.items(), ("README", b"hello")],
        "duplicate-member": [("header.npy", header_arr), *good.items(), ("keys.dense.npy", good["keys.dense.npy"])],
        "keys-float32": [("header.npy", header_arr), *{**good, "keys.dense.npy": np.zeros(FULL, np.float32)}.items()],
        "keys-uint32-bits": [("header.npy", header_arr),
                             *{**good, "keys.dense.npy": np.zeros(FULL, np.uint32)}.items()],
        "keys-big-endian": [("header.npy", header_arr),
                            *{**good, "keys.dense.npy": good["keys.dense.npy"].astype(">u2")}.items()],
        "keys-short": [("header.npy", header_arr), *{**good, "keys.dense.npy": good["keys.dense.npy"][:, :8]}.items()],
        "keys-object": [("header.npy", header_arr),
                        *{**good, "keys.dense.npy": np.empty(FULL, object)}.items()],
        "keys-huge-shape": [("header.npy", header_arr), ("values.dense.npy", good["values.dense.npy"]),
                            ("keys.dense.npy", _npy_with_header("{'descr': '<u2', 'fortran_order': False, "
                                                                "'shape': (1000000000000,), }"))],
        "keys-consistent-but-huge": [  # the header implies 512 GiB of keys; the member holds its npy header only
            ("header.npy", np.frombuffer(json.dumps({**head, "length": 2**31 - 1}).encode(), np.uint8)),
            ("keys.dense.npy", _npy_with_header(f"{{'descr': '<u2', 'fortran_order': False, "
                                                f"'shape': (2, {2**31 - 1}, 8, 8), }}")),
            ("values.dense.npy", good["values.dense.npy"])],
        "keys-truncated-data": [("header.npy", header_arr), ("values.dense.npy", good["values.dense.npy"]),
                                ("token_ids.npy", good["token_ids.npy"]),
                                ("keys.dense.npy", _npy_with_header(
                                    f"{{'descr': '<u2', 'fortran_order': False, 'shape': {FULL}, }}", b"\0" * 100))],
        "keys-bad-npy-header": [("header.npy", header_arr), ("values.dense.npy", good["values.dense.npy"]),
                                ("keys.dense.npy", _npy_with_header("{'descr': __import__('os'), }"))],
        "keys-npy-v3": [("header.npy", header_arr), ("values.dense.npy", good["values.dense.npy"]),
                        ("keys.dense.npy", b"\x93NUMPY\x03\x00" + b"\0" * 60)],
        "keys-not-npy": [("header.npy", header_arr), ("values.dense.npy", good["values.dense.npy"]),
                         ("keys.dense.npy", b"just some bytes")],
    }
    for name, tokens in {"short": np.arange(8, dtype=np.int32), "long": np.arange(10, dtype=np.int32),
                         "negative": np.full(9, -1, np.int32), "too-big": np.full(9, 2**31, np.int64),
                         "uint64-huge": np.full(9, 2**64 - 5, np.uint64), "float": np.arange(9.0),
                         "bool": np.ones(9, bool), "2d": np.zeros((9, 1), np.int32),
                         "object": np.array([1] * 9, object)}.items():
        member_attacks[f"token-ids-{name}"] = [("header.npy", header_arr),
                                               *{**good, "token_ids.npy": tokens}.items()]
    for name, members in member_attacks.items():
        yield pytest.param(lambda m=members: npz(m), None, id=f"member-{name}")
    blob = D().to_bytes()
    rng = np.random.default_rng(0)
    containers = {
        "empty": b"", "one-byte": b"P", "zip-magic-only": b"PK\x03\x04", "random-100": rng.bytes(100),
        "random-4096": rng.bytes(4096), "npy": _npy_bytes(), "pickle": pickle.dumps({"header": 1}),
        "text-zip": npz([("a.txt", b"hello")]), "empty-zip": npz([]),
        **{f"truncated-{n}": blob[:n] for n in (10, 100, len(blob) // 2, len(blob) - 22, len(blob) - 1)},
        "trailing-garbage-in-member": _grow_member(blob),
    }
    for name, data in containers.items():
        yield pytest.param(lambda d=data: d, None, id=f"container-{name}")


def _npy_bytes() -> bytes:
    out = io.BytesIO()
    np.save(out, np.zeros(3))
    return out.getvalue()


def _grow_member(blob: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    return npz([(n, d + b"\0" * 16 if n == "keys.dense.npy" else d) for n, d in members])


FILE_CASES = list(_file_cases())


@pytest.mark.parametrize("build, match", FILE_CASES)
def test_crafted_files_are_refused(build, match, tmp_path):
    blob = build()
    raises(ValueError, match, SequenceExport.from_bytes, blob)
    path = tmp_path / "x.npz"
    path.write_bytes(blob)
    raises(ValueError, match, SequenceExport.load, path)


def stable_id(arg) -> str:
    """The argument's repr without a memory address, so every pytest-xdist worker collects the
    same test ids."""
    text = repr(arg)
    return f"<{type(arg).__name__}>" if " at 0x" in text else text


@pytest.mark.parametrize("arg", [None, 3, 3.5, ["a"], object(), "missing/file.npz", "."], ids=stable_id)
def test_load_refuses_what_is_not_a_file(arg):
    # A directory is a path to no regular file: FileRefusedError (a ValueError) says what it is.
    refused = (FileRefusedError, r"^\. is a directory, not a regular file")
    expected, match = refused if arg == "." else (ValueError, None)
    raises(expected, match, SequenceExport.load, arg)


@pytest.mark.parametrize("arg", [None, "text", 3, [1, 2], io.BytesIO(b"")], ids=stable_id)
def test_from_bytes_refuses_what_is_not_bytes(arg):
    raises(ValueError, "bytes", SequenceExport.from_bytes, arg)


@pytest.mark.parametrize("make", [dense_export, raw_export, lambda: raw_export(quantization="int4-g4"),
                                  lambda: raw_export(quantization="fp8"), lambda: dense_export(tokens=False)])
def test_files_round_trip_exactly(make, tmp_path):
    export = make()
    assert SequenceExport.from_bytes(export.to_bytes()) == export
    export.save(tmp_path / "e.npz")
    with open(tmp_path / "e.npz", "rb") as f:
        assert SequenceExport.load(f) == export
    assert SequenceExport.load(str(tmp_path / "e.npz")) == export


def _tiny(raw: bool) -> SequenceExport:
    return raw_export(length=2, heads=1, layers=1, head_dim=2) if raw else dense_export(length=2, heads=1, layers=1,
                                                                                        head_dim=2)


@pytest.mark.parametrize("raw", [False, True], ids=["dense", "raw-int8"])
def test_byte_flips_are_refused_or_harmless(raw):
    """Flip every byte of a small export file (two ways): each load either raises ValueError or
    returns an export equal to the original (zip bytes that nothing reads, e.g. timestamps)."""
    export = _tiny(raw)
    blob = export.to_bytes()
    loaded = refused = 0
    for i in range(len(blob)):
        for mask in (0x01, 0xFF):
            flipped = bytearray(blob)
            flipped[i] ^= mask
            try:
                got = SequenceExport.from_bytes(bytes(flipped))
            except ValueError:
                refused += 1
                continue
            assert got == export, f"byte {i} ^ {mask:#x} loaded a different export"
            loaded += 1
    assert refused > len(blob)  # most flips land in checked bytes


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)


@given(field=st.sampled_from(["format", "length", "num_hidden_layers", "num_kv_heads", "kv_head_dim_size", "dtype",
                              "quantization", "raw", "source_page_size", "dtypes", "other"]), value=JSON)
def test_any_header_value_is_refused_or_consistent(field, value):
    try:
        got = SequenceExport.from_bytes(file_with(_tiny(False), header={field: value}))
    except ValueError:
        return
    assert SequenceExport.from_bytes(got.to_bytes()) == got
