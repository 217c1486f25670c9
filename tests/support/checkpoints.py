"""A small engine run to checkpoint: a cache (any layout, any quantizer) driven by a PageManager
with live sequences, a shared prompt prefix, a fork (resolved by copy-on-write) and a released
sequence whose full pages stay cached. Deterministic, so a subprocess and the test build the same state.

Pools are those of cache_helpers: 2 layers, 24 pages of 4 tokens, head_dim 8, bf16 logical.
"""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np

from easykv import PagedAttentionCache, PagedAttentionCacheMetaData
from easykv.manager.manager import PageManager
from easykv.runner import Runner
from easykv.sharding import PartitionManager, ShardingAdjustedWarning
from tests.support.pools import HEAD_DIM, LAYERS, LAYOUTS, MAX_LEN, PAGE_SIZE, PAGES, mesh_for, random_tokens


@functools.cache
def qsetup(layout: str, quantizer: str = "none", pages: int = PAGES, page_size: int = PAGE_SIZE):
    """(mesh, partition manager, metadata) for a layout and quantizer."""
    _, paxis, heads = LAYOUTS[layout]
    mesh, pm = mesh_for(layout), PartitionManager(paxis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        meta = PagedAttentionCacheMetaData.create(
            mesh, 4, LAYERS, MAX_LEN, page_size, heads, HEAD_DIM, 0.9, "bfloat16",
            partition_manager=pm, quantizer=quantizer, num_pages_per_layer=pages,
        )  # fmt: skip
    return mesh, pm, meta


def new_qcache(layout: str, quantizer: str = "none", **kw) -> PagedAttentionCache:
    mesh, pm, meta = qsetup(layout, quantizer, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)
        return PagedAttentionCache.init_cache(mesh, meta.dtype, meta, pm, quantizer)


def write_step(cache, manager, seqs, counts, tokens, rng):
    """One engine step: schedule, apply the plan's copies/scrubs, write random K/V, commit ``tokens``."""
    plan = manager.schedule(seqs, counts, pad_tokens_to=16)
    heads = cache.metadata.num_kv_heads
    keys = random_tokens(rng, (LAYERS, 16, heads, HEAD_DIM))
    values = random_tokens(rng, (LAYERS, 16, heads, HEAD_DIM))
    runner = Runner(manager, cache)
    dropped = runner.run(plan, lambda cache, plan: cache.write(keys, values, plan.metadata), token_ids=tokens)
    assert int(dropped) == 0
    return runner.cache


def engine_run(layout: str = "heads", quantizer: str = "none", seed: int = 0):
    """(cache, manager, rng) mid-run: a, b share a prompt prefix, c forks a (its shared
    partial page is copied on its first write), d was released (its full pages are cached)."""
    rng = np.random.default_rng(seed)
    cache = new_qcache(layout, quantizer)
    manager = PageManager(qsetup(layout, quantizer)[2])
    prompt = list(range(10))
    a, b = manager.claim(2)
    cache = write_step(cache, manager, [a], [10], [prompt], rng)
    done = manager.match_prefix(b, prompt)
    assert done == 8
    cache = write_step(cache, manager, [b], [2], [prompt[done:]], rng)
    c = manager.fork(a)
    cache = write_step(cache, manager, [c, a], [1, 1], [[40], [41]], rng)
    [d] = manager.claim(1)
    cache = write_step(cache, manager, [d], [9], [list(range(100, 109))], rng)
    manager.release(d)
    manager.check_invariants()
    return cache, manager, rng


def raw_leaves(cache) -> list[np.ndarray]:
    """Every page array (values and scales) as raw bits, host copies."""
    out = []
    for leaf in jax.tree.leaves(cache):
        a = np.asarray(leaf)
        out.append(a.view(f"u{a.dtype.itemsize}").copy())
    return out


def assert_same_bits(a, b) -> None:
    la, lb = raw_leaves(a), raw_leaves(b)
    assert len(la) == len(lb)
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.shape == y.shape and np.array_equal(x, y), f"leaf {i} differs"


# ---- editing a saved step's JSON, as damage or an attacker would ------------------------------
def record_path(directory, step: int = 0):
    from pathlib import Path

    return Path(directory) / str(step) / "easykv" / "checkpoint.json"


def manager_path(directory, step: int = 0):
    return record_path(directory, step).with_name("manager.json")


def load_record(directory, step: int = 0) -> dict:
    import json

    return json.loads(record_path(directory, step).read_text())


def write_record(directory, record: dict, step: int = 0, *, reseal: bool = True) -> None:
    """Write ``record`` as the step's record; ``reseal`` recomputes its record_sha256 so that only
    the schema (or the manager's own checks) can catch what was changed."""
    import json

    from easykv.checkpoint.record import RECORD_SEAL, record_digest

    if reseal and RECORD_SEAL in record:
        record = {**record, RECORD_SEAL: record_digest(record)}
    record_path(directory, step).write_text(json.dumps(record, indent=1))


def write_manager(directory, text: str | bytes, step: int = 0, *, reseal: bool = True) -> None:
    """Replace manager.json by ``text`` and (``reseal``) point the record's hash at it."""
    import hashlib

    data = text.encode() if isinstance(text, str) else text
    manager_path(directory, step).write_bytes(data)
    if reseal:
        write_record(directory, {**load_record(directory, step), "manager_sha256": hashlib.sha256(data).hexdigest()},
                     step)


def make_legacy(directory, step: int = 0) -> None:
    """Rewrite a step's record as easykv 0.1 wrote it (format version 1, no record or manager
    hash: `git show 1ce80e3:easykv/checkpoint_format.py`, `_StateHandler._write`)."""
    import json

    record = load_record(directory, step)
    for key in ("manager_sha256", "record_sha256"):
        record.pop(key)
    record["format_version"] = 1
    record_path(directory, step).write_text(json.dumps(record, indent=1))


# ---- the small checkpoint the byte-flip sweeps attack ------------------------------------------
def flip_fixture():
    """(cache, manager, mesh, partition manager): 2 layers of 8 pages (2 kv heads over tp=2,
    page_size 4, head_dim 8, bf16), every byte of every page random and non-zero-ish; a manager
    with live sequences, prefix pages in use and cached, a pending copy-on-write copy (a fork
    truncated inside its shared partial page, not yet rewritten) and a pending scrub (scrub_released)."""
    from easykv.sharding import PartitionAxis, create_mesh

    mesh = create_mesh({"tp": 2}, devices=jax.devices()[:2])
    pm = PartitionManager(PartitionAxis())
    meta = PagedAttentionCacheMetaData.create(mesh, 4, 2, 16, 4, 2, 8, 0.9, "bfloat16", partition_manager=pm,
                                              num_pages_per_layer=8)
    cache = PagedAttentionCache.init_cache(mesh, meta.dtype, meta, pm)
    rng = np.random.default_rng(1234)
    cache = jax.tree.map(
        lambda x: jax.device_put(rng.integers(1, 2**16, size=x.shape, dtype=np.uint16).view(x.dtype), x.sharding),
        cache)
    manager = PageManager(meta, scrub_released=True)
    a, b, d = manager.claim(3)
    manager.commit(manager.schedule([a, d], [6, 5]), [list(range(6)), list(range(50, 55))])  # a: a full page + 2
    assert manager.match_prefix(b, list(range(6))) == 4
    manager.commit(manager.schedule([b], [2]), [[14, 15]])  # b shares a's full page, then goes its own way
    c = manager.fork(a)
    manager.truncate(c, 5)  # c ends inside the partial page it shares with a: its private copy is pending
    manager.release(d)  # its full page stays cached, its partial page is queued for scrubbing
    state = manager.state_dict()
    assert state["copies"] and state["pool"]["scrub"] and state["pool"]["digests"], state
    return cache, manager, mesh, pm


def checkpoint_files(directory) -> list:
    """Every file of a checkpoint directory (orbax's and easykv's), sorted by path."""
    from pathlib import Path

    return sorted(p for p in Path(directory).rglob("*") if p.is_file())


def file_kind(path, directory) -> str:
    """A name for a file's role, shared by the files of the same kind (chunk files, .zarray)."""
    rel = path.relative_to(directory)
    if rel.parent.name.startswith(("group_", "layer_")):
        return f"pages/*/{rel.name if rel.name.startswith('.') else 'chunk'}"
    return str(rel).replace("0/", "<step>/", 1) if rel.parts[0] == "0" else str(rel)


def flip_outcome(directory, path, position: int, bit: int, mesh, pm, want_bits, want_state, want_meta, *,
                 inspect: bool = False):
    """Flip one bit of one file, restore the step, put the byte back. The outcome: "identical"
    (every array bit-identical, the manager state and metadata equal), the CheckpointError's
    class name, or "SILENT" / "RAW <type>" (both bugs). With ``inspect``, (outcome, what
    `inspect_report` said of the damaged directory: "intact", "damaged" or "RAW <type>")."""
    from easykv.checkpoint.checkpointer import restore_cache
    from easykv.checkpoint.inspect import inspect_report
    from easykv.errors import CheckpointError

    data = path.read_bytes()
    damaged = bytearray(data)
    damaged[position] ^= 1 << bit
    path.write_bytes(bytes(damaged))
    try:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)  # a v1 (unverified) restore must not happen silently
                restored = restore_cache(directory, mesh=mesh, partition_manager=pm)
            same = (all(np.array_equal(a, b) for a, b in zip(raw_leaves(restored.cache), want_bits))
                    and restored.manager is not None and restored.manager.state_dict() == want_state
                    and restored.metadata == want_meta)
            outcome = "identical" if same else "SILENT"
        except CheckpointError as err:
            outcome = type(err).__name__
        except Exception as err:  # noqa: BLE001  a raw error is a finding, reported by the caller
            outcome = f"RAW {type(err).__name__}: {str(err)[:200]}"
        if not inspect:
            return outcome
        try:
            report = "intact" if inspect_report(directory)[1] else "damaged"
        except Exception as err:  # noqa: BLE001
            report = f"RAW {type(err).__name__}: {str(err)[:200]}"
        return outcome, report
    finally:
        path.write_bytes(data)
