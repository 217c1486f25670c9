"""The page manager of a sliding-window or chunked cache releases the pages that left every
window: exact page ids on a 10-page pool, forks, release, and the state with its holes."""

import numpy as np
import pytest

from easykv import LayerGroup, PagedAttentionCacheMetaData, PageManager
from easykv.errors import InvariantError, ManagerStateError

PAD = -1


def meta(kind="sliding", window=5, pages=10):
    return PagedAttentionCacheMetaData(
        batch_size=3, num_hidden_layers=2, num_pages_per_layer=pages, num_pages_per_sequence=8, max_sequences=32,
        page_size=4, num_kv_heads=2, kv_head_dim_size=8, hbm_utilization=0.9,
        layer_groups=(LayerGroup((0, 1), kind, window, num_pages=pages),))


def grow(m, seq, tokens):
    m.commit(m.schedule([seq], [len(tokens)]), [list(tokens)])


def test_sliding_window_releases_pages_wholly_before_the_next_query():
    m = PageManager(meta("sliding", 5))
    s = m.claim(1)[0]
    grow(m, s, range(1, 7))  # positions 0..5; the next query (6) reads 2..6: page 0 (0..3) still needed
    assert m.page_table([s])[0].tolist() == [0, 1] + [PAD] * 6
    grow(m, s, [7, 8])  # next query 8 reads 4..8: page 0 is dead and goes to the prefix cache (hashed)
    assert m.page_table([s])[0].tolist() == [PAD, 1] + [PAD] * 6
    assert (m.metrics.used_pages, m.metrics.cached_pages, m.metrics.free_pages) == (1, 1, 8)
    grow(m, s, [9])
    assert m.page_table([s])[0].tolist() == [PAD, 1, 2] + [PAD] * 5
    m.check_invariants()
    m.release(s)
    assert (m.metrics.used_pages, m.metrics.cached_pages, m.metrics.free_pages) == (0, 2, 8)


def test_chunked_cache_keeps_only_the_current_chunk():
    m = PageManager(meta("chunked", 8))
    s = m.claim(1)[0]
    m.commit(m.schedule([s], [7]))  # not hashed: released pages go straight back to the free list
    assert m.page_table([s])[0][:2].tolist() == [0, 1]
    m.commit(m.schedule([s], [1]))  # length 8: the next query starts chunk 1, so chunk 0's pages are dead
    assert m.page_table([s])[0][:2].tolist() == [PAD, PAD]
    assert (m.metrics.used_pages, m.metrics.cached_pages, m.metrics.free_pages) == (0, 0, 10)
    m.schedule([s], [1])
    assert m.page_table([s])[0][:3].tolist() == [PAD, PAD, 0]  # the freed page 0 is handed out again
    m.check_invariants()


def test_a_window_sequence_never_holds_more_than_its_window_pages():
    m = PageManager(meta("sliding", 5, pages=10))
    seqs = m.claim(3)
    for t in range(30):  # 3 sequences x 30 tokens = 90 positions in a 40-token pool
        for s in seqs:
            m.commit(m.schedule([s], [1]), [100 * s + t])
        held = [int(np.sum(m.page_table([s])[0] >= 0)) for s in seqs]
        assert max(held) <= LayerGroup((0,), "sliding", 5).pages_per_sequence(32, 4) + 1  # + the page reserved ahead
        m.check_invariants()


def test_fork_shares_the_window_and_keeps_the_holes():
    m = PageManager(meta("sliding", 5))
    s = m.claim(1)[0]
    grow(m, s, range(1, 10))  # length 9: page 0 released, pages 1 and 2 held
    child = m.fork(s)
    assert m.page_table([s, child]).tolist() == [[PAD, 1, 2] + [PAD] * 5] * 2
    m.check_invariants()
    plan = m.schedule([child], [1])  # the child writes into the shared partial page 2: a private copy
    (src,), (dst,) = plan.work.copies()  # (the device would copy them here)
    assert src.tolist() == [2] and m.page_table([child])[0][:3].tolist() == [PAD, 1, int(dst[0])]
    m.commit(plan, [[50]])
    m.release(s)
    m.check_invariants()


def test_state_round_trips_with_holes_and_refuses_crafted_ones():
    m = PageManager(meta("sliding", 5))
    s = m.claim(1)[0]
    grow(m, s, range(1, 10))
    state = m.state_dict()
    assert state["config"]["attention"] == "sliding" and state["config"]["window"] == 5
    assert state["sequences"][0]["pages"] == [PAD, 1, 2]
    again = PageManager.from_state_dict(meta("sliding", 5), state)
    assert again.state_dict() == state
    bad = {**state, "sequences": [{**state["sequences"][0], "pages": [1, PAD, 2]}]}
    with pytest.raises(ManagerStateError, match="released page \\(-1\\) after a held one"):
        PageManager.from_state_dict(meta("sliding", 5), bad)
    early = {**state, "sequences": [{**state["sequences"][0], "pages": [PAD, PAD, 2]}]}
    with pytest.raises(ManagerStateError, match="released its first 2 pages, but its window releases exactly 1"):
        PageManager.from_state_dict(meta("sliding", 5), early)
    with pytest.raises(ManagerStateError, match="saved for another pool"):
        PageManager.from_state_dict(meta("sliding", 6), state)
    with pytest.raises(ManagerStateError, match="saved for another pool|config"):
        PageManager.from_state_dict(meta("full", None), state)


@pytest.mark.parametrize("kind, window, length", [("sliding", 5, 6), ("chunked", 8, 6)])
def test_a_page_released_one_step_early_breaks_the_window_invariant(kind, window, length):
    """The window release run with a length one page ahead frees a page the next query still
    reads: check_invariants calls it a bug, and a state of that manager is refused."""
    m = PageManager(meta(kind, window))
    s = m.claim(1)[0]
    grow(m, s, range(1, length + 1))  # the next query (position 6) still reads column 0
    m.check_invariants()
    # Reached into on purpose: no public call releases a page early; this is the bug the invariant must catch.
    table, seqs = m._groups[0], m._seqs
    table.release_out_of_window(np.array([s]), np.array([length + 4]), seqs.version, m._versions.current)
    assert m.page_table([s])[0][0] == PAD
    with pytest.raises(InvariantError, match=r"next query reads from position \d+ on, in column 0, whose page is gone"):
        m.check_invariants()
    with pytest.raises(ManagerStateError, match="whose page is gone") as err:
        PageManager.from_state_dict(m.metadata, m.state_dict())
    assert err.value.field == f"sequences[id={s}].pages"


def test_a_hole_inside_the_window_breaks_the_window_invariant():
    m = PageManager(meta("sliding", 5))
    s = m.claim(1)[0]
    grow(m, s, range(1, 7))  # pages [0, 1]; the next query reads positions 2..6
    # Broken on purpose (no public call can): column 1 loses its page, column 0 keeps one.
    m._groups[0].table[s, 1] = PAD
    with pytest.raises(InvariantError, match="holds no page at column 1, inside the columns 0..1 its queries read"):
        m.check_invariants()
    with pytest.raises(ManagerStateError, match=r"released page \(-1\) after a held one"):
        PageManager.from_state_dict(m.metadata, m.state_dict())


def test_a_resumed_sequence_inside_its_floor_is_not_held_to_the_window_invariant():
    m = PageManager(meta("sliding", 5))
    s = m.claim(1)[0]
    m.resume(s, 8)  # columns 0 and 1 never held: the window of length 8 (4..8) reaches before the floor
    m.commit(m.schedule([s], [1]))
    assert m.page_table([s])[0][:3].tolist() == [PAD, PAD, 0] and m.sequence(s).first_kept == (8,)
    m.check_invariants()
    assert PageManager.from_state_dict(m.metadata, m.state_dict()).state_dict() == m.state_dict()


@pytest.mark.parametrize("kind,window", [("sliding", 5), ("sliding", 3), ("chunked", 8)])
def test_attention_through_a_window_manager_matches_the_dense_reference(kind, window):
    """A real cache on tp=8 whose 12-page pool is far smaller than the tokens written: pages
    that left the window are reused, and attention with the group's window still matches a
    dense numpy reference over each sequence's whole history. Read without the window, the
    manager's table (holes where pages were released) is refused, not read."""
    from easykv import PagedAttentionCache, paged_attention
    from easykv.sharding import PartitionAxis, PartitionManager
    from tests.support.attention import numpy_attention
    from tests.support.pools import mesh_for

    mesh, pm = mesh_for("heads"), PartitionManager(PartitionAxis())
    meta = PagedAttentionCacheMetaData.create(
        mesh, 2, 2, 32, 4, 8, 8, 0.9, "float32", partition_manager=pm,
        layer_groups=(LayerGroup((0, 1), kind, window, num_pages=12),))
    cache = PagedAttentionCache.init_cache(mesh, meta.dtype, meta, pm)
    m, rng = PageManager(meta), np.random.default_rng(0)
    seqs = m.claim(2)
    hist = {s: (np.zeros((0, 8, 8)), np.zeros((0, 8, 8))) for s in seqs}  # layer 1's K and V
    opts = {"sliding_window": window} if kind == "sliding" else {"chunk_size": window}
    refused = 0
    for counts in [[6, 3]] + [[1, 2]] * 14:
        plan = m.schedule(seqs, counts)
        (step_meta,) = plan.metadata
        n = sum(counts)
        k, v = (rng.standard_normal((2, n, 8, 8)).astype(np.float32) for _ in range(2))
        cache, dropped = cache.write(k, v, step_meta)
        assert int(dropped) == 0
        q = rng.standard_normal((n, 8, 8)).astype(np.float32)
        out = np.asarray(paged_attention(q, cache.views[1].key_pages, cache.views[1].value_pages, step_meta, **opts))
        t = 0
        for s, c in zip(seqs, counts):
            hk, hv = (np.concatenate([h, x[1, t:t + c]]) for h, x in zip(hist[s], (k, v)))
            hist[s] = (hk, hv)
            pos = np.arange(len(hk) - c, len(hk))
            want = numpy_attention(q[t:t + c], hk, hv, pos, window=window if kind == "sliding" else None,
                                   chunk=window if kind == "chunked" else None)
            np.testing.assert_allclose(out[t:t + c], want, rtol=2e-5, atol=2e-5)
            t += c
        table = np.asarray(step_meta.page_table)[:2]
        if np.any((table[:, :1] == PAD) & (table[:, 1:] != PAD).any(axis=1, keepdims=True)):  # a hole
            for wider in ({}, {"sliding_window": 32}):  # no window, or one wider than the group's
                with pytest.raises(ValueError, match="is no page .*released when it left a sliding or chunked window"):
                    paged_attention(q, cache.views[1].key_pages, cache.views[1].value_pages, step_meta, **wider)
            refused += 1
        m.commit(plan)
        m.check_invariants()
    assert refused and m.metrics.free_pages + m.metrics.used_pages == 12
    assert sum(len(h[0]) for h in hist.values()) > 12 * 4  # more tokens than the pool holds


def _window_pair(layout, kind, window, pages=12):
    from easykv import PagedAttentionCache
    from easykv.sharding import PartitionManager
    from tests.support.pools import LAYOUTS, mesh_for

    mesh, pm = mesh_for(layout), PartitionManager(LAYOUTS[layout][1])
    meta = PagedAttentionCacheMetaData.create(
        mesh, 3, 2, 32, 4, 8, 8, 0.9, "bfloat16", partition_manager=pm,
        layer_groups=(LayerGroup((0, 1), kind, window, num_pages=pages),))
    return mesh, pm, PagedAttentionCache.init_cache(mesh, meta.dtype, meta, pm), PageManager(meta)


def _held_bits(cache, manager):
    """Per sequence and layer, the raw bits of the pages it still holds (holes skipped)."""
    out = {}
    for s in manager.active_ids:
        held = [p for p in manager.pages(s) if p != PAD]
        for layer, view in enumerate(cache.views):
            out[s, layer] = tuple(np.asarray(x)[:, held].view(np.uint16) for x in (view.key_pages, view.value_pages))
    return out


@pytest.mark.parametrize("kind,window", [("sliding", 5), ("chunked", 8)])
def test_a_window_cache_checkpoint_restores_onto_another_mesh(tmp_path, kind, window):
    """Saved from a dp=2 x tp=4 page-split pool whose sequences hold holes (one chunked
    sequence holds none of its pages any more), restored onto tp=8: the holes, the window in
    the manager's config and every held page's bits come back; both pairs continue alike."""
    import jax
    import jax.numpy as jnp

    from easykv import paged_attention, restore_cache, save_cache

    _, _, cache, m = _window_pair("dp", kind, window)
    rng = np.random.default_rng(1)
    seqs = m.claim(3)
    for counts in ([6, 8, 3], [1, 0, 2], [1, 0, 2], [2, 0, 1]):
        plan = m.schedule(seqs, counts)
        k = rng.standard_normal((2, sum(counts), 8, 8)).astype(jnp.bfloat16)
        cache, _ = cache.write(k, -k, plan.metadata)
        m.commit(plan, [list(range(s * 50 + m.length(s), s * 50 + m.length(s) + c)) for s, c in zip(seqs, counts)])
    assert PAD in m.pages(seqs[0])
    if kind == "chunked":
        assert m.pages(seqs[1]) == [PAD, PAD]  # length 8: the whole first chunk released
    save_cache(tmp_path, cache, m)
    mesh, pm, _, _ = _window_pair("heads", kind, window)
    restored = restore_cache(tmp_path, mesh=mesh, partition_manager=pm)
    r_cache, r_m = restored
    assert restored.metadata.groups[0].attention == kind and restored.metadata.page_shards == 1
    assert r_m.state_dict()["config"]["window"] == window
    assert [r_m.pages(s) for s in seqs] == [m.pages(s) for s in seqs]
    assert r_m.state_dict() == m.clone(restored.metadata).state_dict()
    r_m.check_invariants()
    got, want = _held_bits(r_cache, r_m), _held_bits(cache, m)
    assert got.keys() == want.keys() and all(np.array_equal(a, b) for k in want for a, b in zip(got[k], want[k]))
    opts = {"sliding_window": window} if kind == "sliding" else {"chunk_size": window}
    k = rng.standard_normal((2, 3, 8, 8)).astype(jnp.bfloat16)
    q = rng.standard_normal((3, 8, 8)).astype(jnp.bfloat16)
    outs = []
    for c, mgr in ((cache, m), (r_cache, r_m)):
        plan = mgr.schedule(seqs, [1, 1, 1])
        (step_meta,) = plan.metadata
        c, _ = c.write(k, -k, step_meta)
        outs.append(np.asarray(jax.device_get(paged_attention(q, c.views[0].key_pages, c.views[0].value_pages,
                                                              step_meta,
                                                              dtype=jnp.bfloat16, **opts)), np.float32))
        mgr.commit(plan)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_resharding_keeps_a_sequence_whose_pages_all_left_the_window_bound():
    m = PageManager(meta("chunked", 8, pages=12))
    s = m.claim(1)[0]
    grow(m, s, range(8))  # length 8: both pages of chunk 0 released
    assert m.pages(s) == [PAD, PAD] and m.sequence(s).replica == 0
    split = m.clone(meta("chunked", 8, pages=12).replace(page_shards=2))
    split.check_invariants()
    assert split.pages(s) == [PAD, PAD] and split.sequence(s).replica == 0
    grow(split, s, [9])  # the next chunk's page comes from its replica's slice
    assert split.pages(s)[2] in range(6)


def _write_tokens(cache, m, seqs, counts, rng):
    import jax.numpy as jnp

    plan = m.schedule(seqs, counts)
    k = rng.standard_normal((2, sum(counts), 8, 8)).astype(jnp.bfloat16)
    cache, dropped = cache.write(k, (k * 3).astype(jnp.bfloat16), plan.metadata)
    assert int(dropped) == 0
    m.commit(plan, [list(range(m.length(s), m.length(s) + c)) for s, c in zip(seqs, counts)])
    return cache, k


@pytest.mark.parametrize("kind,window", [("sliding", 5), ("chunked", 8)])
def test_export_of_a_window_sequence_holds_its_window_and_imports_into_the_same_window(kind, window):
    """A 30-token sequence of a window cache exports exactly the positions its window still
    reads (bit for bit what was written there); imported into another cache of that window it
    holds only the window's pages, reads like the source under attention, and re-exports the
    same; a full-attention cache refuses it by name, before any state changes."""
    import jax.numpy as jnp

    from easykv import export_sequence, import_sequence, paged_attention

    _, _, cache, m = _window_pair("heads", kind, window)
    rng = np.random.default_rng(2)
    [s] = m.claim(1)
    written = []
    for c in (6, 9, 7, 8):  # 30 tokens in a 12-page pool of 4-token pages, through a 2-page window
        cache, k = _write_tokens(cache, m, [s], [c], rng)
        written.append(k)
    k_all = np.concatenate(written, axis=1)
    first = max(0, 30 - window + 1) if kind == "sliding" else 30 - 30 % window
    assert m.sequence(s).first_kept == (first,)
    exp = export_sequence(cache, m, s, token_ids=range(30))
    assert exp.first_position == first and exp.length == 30 and exp.token_ids.tolist() == list(range(30))
    np.testing.assert_array_equal(np.asarray(exp.keys).view(np.uint16), k_all[:, first:].view(np.uint16))
    assert type(exp).from_bytes(exp.to_bytes()) == exp

    _, _, target, t = _window_pair("heads", kind, window)
    [other] = t.claim(1)
    target, _ = _write_tokens(target, t, [other], [5], rng)  # the target is not empty
    target, got = import_sequence(target, t, exp)
    t.check_invariants()
    assert t.length(got) == 30 and t.sequence(got).first_kept == (first,)
    held = [p for p in t.pages(got) if p != PAD]
    assert len(held) == -(-30 // 4) - first // 4  # the window's pages only
    assert export_sequence(target, t, got, token_ids=range(30)) == exp
    q = rng.standard_normal((2, 8, 8)).astype(jnp.bfloat16)
    opts = {"sliding_window": window} if kind == "sliding" else {"chunk_size": window}
    outs = []
    for c, mgr, seq in ((cache, m, s), (target, t, got)):
        (step_meta,) = mgr.schedule([seq], [2]).metadata
        k = np.ones((2, 2, 8, 8), jnp.bfloat16)
        c, _ = c.write(k, k, step_meta)
        outs.append(np.asarray(paged_attention(q, c.views[1].key_pages, c.views[1].value_pages, step_meta,
                                               dtype=jnp.bfloat16, **opts), np.float32))
    np.testing.assert_array_equal(outs[0], outs[1])

    _, _, full, f = _window_pair("heads", "full", None)
    state = f.state_dict()
    with pytest.raises(ValueError, match=f"holds positions {first}..29 only .*reads every position"):
        import_sequence(full, f, exp)
    assert f.state_dict() == state and not full.views[0].key_pages.is_deleted()


def test_a_long_full_export_imports_into_a_small_window_pool():
    """A 30-token export from a full-attention cache goes into a sliding cache of 4 pages (it
    could never hold the 8 pages of the whole sequence): only the window's pages are taken and
    written, nothing is entered in the prefix cache, and the sequence decodes on."""
    from easykv import export_sequence, import_sequence

    _, _, cache, m = _window_pair("heads", "full", None)
    rng = np.random.default_rng(3)
    [s] = m.claim(1)
    cache, k = _write_tokens(cache, m, [s], [30], rng)
    exp = export_sequence(cache, m, s)
    assert exp.first_position == 0
    _, _, target, t = _window_pair("heads", "sliding", 5, pages=4)
    target, got = import_sequence(target, t, exp)
    t.check_invariants()
    assert t.pages(got)[:6] == [PAD] * 6 and t.metrics.cached_pages == 0
    back = export_sequence(target, t, got)
    assert back.first_position == 26
    np.testing.assert_array_equal(np.asarray(back.keys).view(np.uint16), k[:, 26:].view(np.uint16))
    for _ in range(2):  # up to max_sequences=32
        target, _ = _write_tokens(target, t, [got], [1], rng)
        t.check_invariants()


def test_resume_starts_a_sequence_at_a_window_page_and_refuses_misuse():
    m = PageManager(meta("sliding", 5))
    s, busy = m.claim(2)
    m.resume(s, 9)  # page 2 is the first whose positions the window may read
    assert (m.length(s), m.pages(s), m.sequence(s).first_kept) == (8, [PAD, PAD], (8,))
    state = m.state_dict()
    assert state["sequences"][0]["floor"] == 8
    m.check_invariants()
    assert PageManager.from_state_dict(meta("sliding", 5), state).state_dict() == state
    plan = m.schedule([s], [2])
    (step_meta,) = plan.metadata
    assert np.asarray(step_meta.slot_mapping)[:2].tolist() == [0, 1]  # page 0 is the first free one
    m.commit(plan)  # length 10: the window (6..10) still reaches before the floor
    assert m.sequence(s).first_kept == (8,) and m.state_dict()["sequences"][0]["floor"] == 8
    m.commit(m.schedule([s], [3]))  # length 13: the window starts at 9, past the floor, which is forgotten
    assert "floor" not in m.state_dict()["sequences"][0] and m.sequence(s).first_kept == (9,)
    m.check_invariants()
    grow(m, busy, [1])
    [fresh] = m.claim(1)
    before = m.state_dict()
    with pytest.raises(ValueError, match="already holds 1 tokens in 1 pages; resume right after claim"):
        m.resume(busy, 4)
    with pytest.raises(ValueError, match="first_position"):
        m.resume(fresh, 32)
    full = PageManager(meta("full", None))
    with pytest.raises(ValueError, match="needs a sliding or chunked cache"):
        full.resume(full.claim(1)[0], 4)
    bad = {**state, "sequences": [{**state["sequences"][0], "floor": 6}]}
    with pytest.raises(ManagerStateError, match="floor 6 of sequence 0 .* multiple of page_size=4"):
        PageManager.from_state_dict(meta("sliding", 5), bad)
    assert m.state_dict() == before


@pytest.mark.parametrize("first", [8, 9, 11])
def test_a_sequence_resumed_at_a_chunk_boundary_keeps_no_floor(first):
    """Chunks of 8, pages of 4: resumed at 8..11, the sequence holds 8 positions' columns as holes
    and its next query reads from 8 on, so no floor is left for a window that already passed it
    (the state it gave was refused on load, and check_invariants failed)."""
    m = PageManager(meta("chunked", 8))
    s = m.claim(1)[0]
    m.resume(s, first)
    assert (m.length(s), m.pages(s), m.sequence(s).first_kept) == (8, [PAD, PAD], (8,))
    assert "floor" not in m.state_dict()["sequences"][0]
    m.check_invariants()
    state = m.state_dict()
    assert PageManager.from_state_dict(meta("chunked", 8), state).state_dict() == state
    m.commit(m.schedule([s], [3]))
    assert m.pages(s) == [PAD, PAD, 0] and m.sequence(s).first_kept == (8,)
    m.check_invariants()


def test_a_sliding_prefix_hit_needs_only_the_window_pages():
    """Pages released from a window enter the prefix cache tail-first (evicted first). With
    page 2 of a cached 16-token history evicted, a full-attention walk would stop at 8 tokens;
    the window of a 16-token sequence reads positions 12..16 only, so page 3 alone gives a
    16-token hit, and the row holds exactly that page."""
    m = PageManager(meta("sliding", 5, pages=10))
    a = m.claim(1)[0]
    grow(m, a, range(16))  # pages 0..3, hashed; 0..2 leave the window (tail first: 2, 1, 0)
    m.release(a)  # page 3 joins them: cached 2, 1, 0, 3 in eviction order
    b = m.claim(1)[0]
    plan = m.schedule([b], [28])  # pages 4..9 and the oldest cached page: 2
    assert m.pages(b) == [4, 5, 6, 7, 8, 9, 2]
    m.commit(plan)
    m.release(b)
    c = m.claim(1)[0]
    assert m.cached_prefix_length(list(range(16)) + [99]) == 16
    assert m.match_prefix(c, list(range(16)) + [99]) == 16
    assert m.pages(c) == [PAD, PAD, PAD, 3] and m.sequence(c).first_kept == (12,)
    assert m.metrics.used_pages == 1
    m.check_invariants()
    grow(m, c, [99])
    assert m.pages(c)[4] >= 0 and m.length(c) == 17


def test_a_chunked_prefix_hit_needs_only_its_chunk_and_never_a_bare_boundary():
    m = PageManager(meta("chunked", 8, pages=10))
    a = m.claim(1)[0]
    grow(m, a, range(14))  # chunk 0 (pages 0, 1) released at length 8, hashed; chunk 1 in pages 2, 3
    m.release(a)
    # 12 tokens: the query at 12 reads chunk 1 (8..12): page 2 only.
    c = m.claim(1)[0]
    assert m.match_prefix(c, list(range(12)) + [7]) == 12 and m.pages(c) == [PAD, PAD, 2]
    # A prompt of 9 tokens: a hit of 8 would need no page at all (a chunk boundary), which is
    # no hit; the longest real one is 4 tokens, page 0 (cached when chunk 0 was released).
    d = m.claim(1)[0]
    assert m.match_prefix(d, list(range(9))) == 4 and m.pages(d) == [0]
    m.check_invariants()


def test_a_crafted_window_export_header_is_refused_by_name():
    """A version-2 export header must name a first position in 1..length - 1 (0 is written as
    version 1); a version-1 header may not carry one."""
    import io
    import json

    from easykv.checkpoint.transfer import SequenceExport

    exp = SequenceExport(length=6, num_hidden_layers=1, num_kv_heads=1, kv_head_dim_size=2, dtype="float32",
                         quantization="none", raw=False, keys=np.ones((1, 2, 1, 2), np.float32),
                         values=np.zeros((1, 2, 1, 2), np.float32), first_position=4)
    assert SequenceExport.from_bytes(exp.to_bytes()) == exp

    def crafted(**header):
        with np.load(io.BytesIO(exp.to_bytes())) as npz:
            arrays = {k: npz[k] for k in npz.files}
        head = {**json.loads(arrays["header"].tobytes()), **header}
        arrays["header"] = np.frombuffer(json.dumps(head).encode(), np.uint8)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    for bad in (0, 6, -1, "4"):
        with pytest.raises(ValueError, match="'first_position'"):
            SequenceExport.from_bytes(crafted(first_position=bad))
    with pytest.raises(ValueError, match="unknown entries \\['first_position'\\]"):
        SequenceExport.from_bytes(crafted(format="easykv.SequenceExport/1"))
