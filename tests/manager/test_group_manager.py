"""The PageManager of a cache of several layer groups: one pool and one block table per group,
one step metadata per group, a sliding group that frees what left its window beside a full one
that keeps everything, prefix hits that need every group's pages, forks with copy-on-write in
each pool, the state (format 2) and resharding. Exact page ids on pools of about ten pages;
then a real grouped cache driven by the manager, checked against numpy attention."""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import easykv
from easykv import CacheFullError, LayerGroup, PagedAttentionCache, PagedAttentionCacheMetaData, PageManager
from easykv.errors import ManagerStateError
from easykv.manager.manager import single_group
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning, create_mesh
from easykv.step.ragged import RaggedStep
from tests.support.attention import numpy_attention
from tests.support.tiers import tiered

PAD = -1
PS = 4


def hybrid(full_pages=10, sliding_pages=6, window=5, shards=1, batch=3, kinds=None):
    """Layer 0 full attention, layer 1 a sliding window (or ``kinds``: the groups)."""
    groups = kinds or (LayerGroup((0,), "full", num_pages=full_pages),
                       LayerGroup((1,), "sliding", window, num_pages=sliding_pages))
    return PagedAttentionCacheMetaData(
        batch_size=batch, num_hidden_layers=len(groups), num_pages_per_layer=max(g.num_pages for g in groups),
        num_pages_per_sequence=8, max_sequences=32, page_size=PS, num_kv_heads=2, kv_head_dim_size=8,
        hbm_utilization=0.9, page_shards=shards, layer_groups=groups)


def grow(m, seq, tokens, ids=True):
    plan = m.schedule([seq], [len(tokens)])
    m.commit(plan, [list(tokens)] if ids else None)
    return plan.metadata


def rows(m, seq):
    return [m.pages(seq, group=g) for g in range(m.num_groups)]


def pool_counts(m):
    return [(p.used_pages, p.cached_pages, p.free_pages) for p in m.metrics.groups]


def test_each_group_has_its_table_and_the_sliding_one_frees_what_left_its_window():
    m = PageManager(hybrid())
    s = m.claim(1)[0]
    rts = grow(m, s, range(1, 7))  # positions 0..5: the next query (6) reads 2..6, page 0 still needed
    assert isinstance(rts, tuple) and len(rts) == 2
    assert [step_meta.slot_mapping[:6].tolist() for step_meta in rts] == [[0, 1, 2, 3, 4, 5]] * 2
    assert rows(m, s) == [[0, 1], [0, 1]]
    grow(m, s, [7, 8])  # the next query (8) reads 4..8: the sliding group's page 0 goes to its prefix cache
    assert rows(m, s) == [[0, 1], [PAD, 1]]
    assert pool_counts(m) == [(2, 0, 8), (1, 1, 4)]
    rts = grow(m, s, [9])
    assert rows(m, s) == [[0, 1, 2], [PAD, 1, 2]]
    assert [step_meta.slot_mapping[:1].tolist() for step_meta in rts] == [[8], [8]]
    assert m.sequence(s).first_kept == (0, 5)
    m.check_invariants()
    metrics = m.metrics
    assert (metrics.total_pages, metrics.used_pages, metrics.cached_pages) == (16, 5, 1)
    m.release(s)
    assert pool_counts(m) == [(0, 2, 8), (0, 2, 4)]  # full pages hashed and cached; the partial page freed


def test_memory_of_the_sliding_group_follows_the_window_not_the_sequence():
    m = PageManager(hybrid(full_pages=24, sliding_pages=6, batch=3))
    seqs = m.claim(3)
    for t in range(30):  # 3 x 30 tokens: 24 full pages in use, but never more than 2 sliding pages each
        m.commit(m.schedule(seqs, [1, 1, 1]), [100 * s + t for s in seqs])
        held = [sum(p != PAD for p in m.pages(s, group=1)) for s in seqs]
        assert max(held) <= 2
    assert [len(m.pages(s, group=0)) for s in seqs] == [8, 8, 8]
    m.check_invariants()


def test_a_prefix_hit_needs_every_groups_pages():
    m = PageManager(hybrid())
    prompt = list(range(1, 14))  # 13 tokens: 3 full pages
    a = m.claim(1)[0]
    assert m.match_prefix(a, prompt) == 0
    grow(m, a, prompt)
    assert rows(m, a) == [[0, 1, 2, 3], [PAD, PAD, 2, 3]]  # the next query (13) reads 9..13
    m.release(a)  # full: 0, 1, 2 cached, 3 freed; sliding: 0, 1, 2 cached (in release order), 3 freed
    assert pool_counts(m) == [(0, 3, 7), (0, 3, 3)]
    b = m.claim(1)[0]
    assert m.cached_prefix_length(prompt) == 12
    assert m.match_prefix(b, prompt) == 12  # 3 pages: the sliding group needs only column 2 (positions 8..11)
    assert rows(m, b) == [[0, 1, 2], [PAD, PAD, 2]]
    assert pool_counts(m) == [(3, 0, 7), (1, 2, 3)]
    m.release(b)
    # Another sequence takes every sliding page: the sliding group evicts the prompt's pages
    # (oldest first) while the full group keeps all three cached. No hit can be whole any more.
    c = m.claim(1)[0]
    plan = m.schedule([c], [24])
    assert m.metrics.groups[1].evictions == 3
    m.commit(plan)
    d = m.claim(1)[0]
    assert m.cached_prefix_length(prompt) == 0
    assert m.match_prefix(d, prompt) == 0
    assert m.metrics.groups[0].cached_pages == 3 and m.metrics.prefix_hits == 1
    m.check_invariants()


def test_fork_copies_on_write_in_every_group():
    m = PageManager(hybrid())
    a = m.claim(1)[0]
    grow(m, a, [1, 2, 3, 4, 5, 6])  # pages 0 (full) and 1 (partial) in both groups
    b = m.fork(a)
    assert rows(m, b) == [[0, 1], [0, 1]]
    plan = m.schedule([b], [1])  # b writes into the shared partial page 1 of each group
    assert rows(m, b) == [[0, 2], [0, 2]]
    src, dst = plan.work.copies()
    assert [x.tolist() for x in src] == [[1], [1]] and [x.tolist() for x in dst] == [[2], [2]]
    m.commit(plan, [[7]])
    assert m.metrics.copies == 2
    m.check_invariants()


def test_a_full_small_group_refuses_the_step_and_changes_nothing():
    m = PageManager(hybrid(full_pages=10, sliding_pages=6))
    s = m.claim(1)[0]
    before = m.state_dict()
    with pytest.raises(CacheFullError, match=r"needs 7 pages of layer group 1 but only 6") as err:
        m.schedule([s], [28])  # every token's page is written before the window moves on
    assert (err.value.needed, err.value.available) == (7, 6)
    assert m.state_dict() == before
    grow(m, s, range(24))
    assert rows(m, s)[1] == [PAD, PAD, PAD, PAD, PAD, 5]


def test_the_group_must_be_named_where_the_answer_differs():
    m = PageManager(hybrid())
    s = m.claim(1)[0]
    for call in (lambda: m.pages(s), lambda: m.page_table([s])):
        with pytest.raises(ValueError, match=r"2 layer groups, each with its own pages; pass group=0..1"):
            call()
    with pytest.raises(ValueError, match=r"group must .*got 2 \(valid: 0..1; a layer group of the 2"):
        m.pages(s, group=2)
    assert len(m.sequence(s).first_kept) == 2  # one per group: nothing to name
    with pytest.raises(ValueError, match=r"tuple of 2 step metadata"):
        m.increment_cache_lengths(m.schedule_decode([s], 1).metadata[0])


def test_decode_metadata_is_one_per_group_per_step():
    m = PageManager(hybrid())
    s = m.claim(1)[0]
    grow(m, s, [1, 2, 3])
    plan = m.schedule_decode([s], 3)
    steps = [plan.metadata]
    for _ in range(2):
        steps.append(plan.next_metadata(steps[-1]))
    assert all(len(step) == 2 for step in steps)
    assert [[int(step_meta.slot_mapping[0]) for step_meta in step] for step in steps] == [[3, 3], [4, 4], [5, 5]]
    nxt = m.increment_cache_lengths(steps[0])
    assert [int(step_meta.slot_mapping[0]) for step_meta in nxt] == [4, 4]


@pytest.mark.parametrize("kinds", [(LayerGroup((0,), "full", num_pages=10),),
                                   (LayerGroup((0,), "full", num_pages=10),
                                    LayerGroup((1,), "sliding", 5, num_pages=6)),
                                   (LayerGroup((0,), "full", num_pages=10), LayerGroup((1,), "chunked", 4, num_pages=6),
                                    LayerGroup((2,), "sliding", 5, num_pages=6))],
                         ids=["one group", "two groups", "three groups"])
def test_every_per_group_answer_is_a_tuple_of_one_per_group(kinds):
    """The same shape whatever the number of groups: a step's and a decode plan's metadata, the
    next decode step (the plan's and the manager's), a plan's copies, scrubs and transfers, and the
    work taken without a plan."""
    m = PageManager(hybrid(kinds=kinds), scrub_released=True)
    n = len(kinds)
    s = m.claim(1)[0]
    first = grow(m, s, [1, 2, 3, 4, 5, 6])
    child = m.fork(s)
    plan = m.schedule_decode([child], 2)
    nxt, inc = plan.next_metadata(plan.metadata), m.increment_cache_lengths(plan.metadata)
    src, dst = plan.work.copies()
    answers = [first, plan.metadata, nxt, inc, src, dst, plan.work.scrubs(), plan.work.transfers()]
    assert all(type(a) is tuple and len(a) == n for a in answers), [(type(a), len(a)) for a in answers]
    assert all(isinstance(step_meta, RaggedStep) for step_meta in (*first, *plan.metadata, *nxt, *inc))
    assert [a.tolist() for a in src] == [[1]] * n and [a.tolist() for a in dst] == [[2]] * n  # the child's copy
    m.abort(plan)
    m.release(child)  # its private copy (page 2 of each pool): a scrub in each
    scrubs = m.take_work().scrubs()
    assert type(scrubs) is tuple and [a.tolist() for a in scrubs] == [[2]] * n


def test_single_group_unpacks_a_one_group_answer_and_refuses_the_rest():
    one, two = PageManager(hybrid(kinds=(LayerGroup((0,), "full", num_pages=10),))), PageManager(hybrid())
    for m in (one, two):
        m.claim(1)
    plan = one.schedule([0], [3])
    (step_meta,) = answer = plan.metadata
    assert single_group(answer) is step_meta and step_meta.slot_mapping.tolist() == [0, 1, 2]
    one.commit(plan, [[7, 8, 9]])
    (dec,) = one.schedule_decode([0], 1).metadata
    assert one.increment_cache_lengths(dec)[0].positions.tolist() == [4]  # one group: bare metadata too
    with pytest.raises(ValueError, match=r"one item for each of 2 layer groups; index it by group \(answer\[g\]\)"):
        single_group(two.schedule([0], [3]).metadata)
    with pytest.raises(ValueError, match=r"a plan's work\.copies\(\) gives two, \(src_per_group, dst_per_group\): "
                                         r"unpack each"):
        single_group(plan.work.copies())
    with pytest.raises(ValueError, match=r"takes a per-group answer .* got RaggedStep"):
        single_group(step_meta)
    with pytest.raises(ValueError, match=r"this manager has 1 layer group\(s\): pass a tuple of 1 step metadata.*"
                                         r"got a tuple of 2"):
        one.increment_cache_lengths((step_meta, step_meta))


def test_resume_needs_every_group_windowed():
    m = PageManager(hybrid())
    s = m.claim(1)[0]
    with pytest.raises(ValueError, match=r"in every layer group: in layer group 0 \(full attention\)"):
        m.resume(s, 8)
    w = PageManager(hybrid(kinds=(LayerGroup((0,), "sliding", 3, num_pages=6),
                                  LayerGroup((1,), "chunked", 8, num_pages=10))))
    s = w.claim(1)[0]
    w.resume(s, 9)
    assert rows(w, s) == [[PAD, PAD], [PAD, PAD]] and w.length(s) == 8
    w.commit(w.schedule([s], [4]))  # length 12: the sliding window (10..12) and the chunk (8..15) are past the floor
    assert rows(w, s) == [[PAD, PAD, 0], [PAD, PAD, 0]]
    assert w.sequence(s).first_kept == (10, 8)
    w.check_invariants()


def test_state_round_trips_in_format_2_and_refuses_crafted_ones():
    m = PageManager(hybrid(), scrub_released=True)
    a, b = m.claim(2)
    grow(m, a, range(1, 11))
    grow(m, b, range(50, 53), ids=False)
    c = m.fork(a)
    m.truncate(c, 9)  # c ends inside the partial page it shares with a: a copy pending in each group
    state = json.loads(json.dumps(m.state_dict()))
    assert state["format"] == "easykv.PageManager/2"
    assert state["config"]["groups"] == [{"attention": "full", "window": None, "num_pages": 10},
                                         {"attention": "sliding", "window": 5, "num_pages": 6}]
    assert len(state["pool"]) == 2 and len(state["copies"]) == 2
    assert state["sequences"][0]["pages"] == [[0, 1, 2], [PAD, 1, 2]]
    back = PageManager.from_state_dict(m.metadata, state)
    assert back.state_dict() == state
    theirs, mine = back.take_work(), m.take_work()
    assert [x.tolist() for x in theirs.copies()[1]] == [x.tolist() for x in mine.copies()[1]] == [[4], [4]]

    def crafted(edit):
        bad = json.loads(json.dumps(state))
        edit(bad)
        return bad

    cases = [
        (lambda s: s.update(format="easykv.PageManager/1"), "format", "PageManager/2"),
        (lambda s: s.update(pool=s["pool"][:1]), "pool", "1 entries for 2 layer groups"),
        (lambda s: s["sequences"][0].update(pages=[[0, 1, 2], [PAD, 1, 2, 5]]), "sequences[0].pages[1]", "every group"),
        (lambda s: s["config"]["groups"][1].update(window=6), "config", "another pool"),
        (lambda s: s["sequences"][0]["pages"][1].__setitem__(0, 3), "sequences[id=0].pages", "releases exactly 1"),
        (lambda s: s["pool"][1]["free"][0].append(1), "pool[1]", "listed twice|refcount"),
        (lambda s: s["copies"][1].append([0, 3]), "copies[1][dst=3]", "a page of the prefix cache no sequence holds"),
    ]
    for edit, field, words in cases:
        with pytest.raises(ManagerStateError) as err:
            PageManager.from_state_dict(m.metadata, crafted(edit))
        assert err.value.field.startswith(field), (field, err.value.field, str(err.value))
        if words:
            assert any(w in str(err.value) for w in words.split("|")), str(err.value)
    with pytest.raises(ManagerStateError, match="PageManager/1"):  # a one-group state for a grouped manager
        one_group = PageManager(hybrid(kinds=(LayerGroup((0,), "full", num_pages=10),)))
        PageManager.from_state_dict(m.metadata, one_group.state_dict())


def test_reshard_keeps_each_sequence_in_one_replica_of_every_group():
    m = PageManager(hybrid(full_pages=16, sliding_pages=8, shards=2))
    a, b = m.claim(2)
    grow(m, a, range(1, 10))
    grow(m, b, range(20, 25))
    assert m.sequence(a).replica == 0 and m.sequence(b).replica == 1
    assert rows(m, b) == [[8, 9], [4, 5]]  # replica 1's slices: pages 8..15 and 4..7
    one = m.clone(hybrid(full_pages=16, sliding_pages=8, shards=1))
    assert rows(one, b) == rows(m, b) and one.sequence(b).replica == 0
    two = one.clone(hybrid(full_pages=16, sliding_pages=8, shards=2))
    assert two.state_dict() == m.state_dict()
    # A sequence whose full pages lie in one new slice and its sliding pages in another cannot move.
    m1 = PageManager(hybrid(full_pages=16, sliding_pages=8, shards=1))
    a = m1.claim(1)[0]
    grow(m1, a, range(1, 17))  # full pages 0..3; the sliding group keeps page 3 and caches 0..2
    b = m1.claim(1)[0]
    grow(m1, b, [5])
    assert rows(m1, b) == [[4], [4]]  # page 4: replica 0 of the full group's 8-page slices, 1 of the sliding's 4
    with pytest.raises(ValueError, match=r"layer group 1 of 8 pages into 2 .* sequence 1's pages \[\[4\], \[4\]\] in "
                                         r"replicas \[0, 1\]"):
        m1.clone(hybrid(full_pages=16, sliding_pages=8, shards=2))


# ---- a real grouped cache driven by the manager, against numpy ----------------------------------
GROUPS = (LayerGroup((0, 2), "sliding", 6, num_kv_heads=4, key_head_dim=8, value_head_dim=8, num_pages=16),
          LayerGroup((1, 3), "full", num_kv_heads=8, key_head_dim=16, value_head_dim=8, num_pages=24),
          LayerGroup((4,), "full", num_kv_heads=1, key_head_dim=12, value_head_dim=8, latent=True, num_pages=24))
LAYERS = 5


@pytest.mark.parametrize("layout,quantizer", tiered([("tp8", "none"), ("dp2tp4", "none"), ("dp2tp4", "int8")],
                                                    fast={("tp8", "none")}))
def test_a_manager_driven_grouped_cache_matches_dense_attention(layout, quantizer):
    """Three prompts (the third shares the first's prefix and hits it in every group), a fork,
    then decode steps: each step's metadata and copies come from the manager, the writes and
    attention from the cache; every layer's output is checked against numpy attention over the
    sequence's whole history (the sliding group with its window, after its old pages were freed
    and reused); with int8 pages, against the history each token's quantization gives back."""
    mesh = create_mesh({"dp": 1, "tp": 8}) if layout == "tp8" else create_mesh({"dp": 2, "tp": 4})
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp" if layout == "dp2tp4" else None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingAdjustedWarning)  # the latent's one head is replicated
        meta = PagedAttentionCacheMetaData.create(mesh, 4, LAYERS, 32, PS, 8, 16, 0.9, "float32",
                                                  partition_manager=pm, layer_groups=GROUPS, quantizer=quantizer)
        cache = PagedAttentionCache.init_cache(mesh, jnp.float32, meta, pm, quantizer=quantizer)
    q8 = easykv.get_quantizer(quantizer)

    def stored(x):  # what a page gives back of new rows (tokens, heads, dim)
        return x if quantizer == "none" else np.asarray(q8.quantize(jnp.asarray(x)).dequantize(np.float32))
    meta = cache.metadata
    m = PageManager(meta)
    runner = easykv.Runner(m, cache)
    rng = np.random.default_rng(0)
    groups = [meta.groups[meta.group_of(i)[0]] for i in range(LAYERS)]
    hist: dict[int, list] = {}  # seq -> per layer [K rows, V rows] of its whole history

    def step(seqs, tokens):
        counts = [len(t) for t in tokens]
        plan = m.schedule(seqs, counts)
        rts = plan.metadata
        n = sum(counts)
        ks = [rng.standard_normal((n, g.num_kv_heads, g.key_head_dim)).astype(np.float32) for g in groups]
        vs = [rng.standard_normal((n, g.num_kv_heads, g.value_head_dim)).astype(np.float32) if g.has_values else None
              for g in groups]
        dropped = runner.run(plan, lambda cache, plan: cache.write(ks, vs, plan.metadata), token_ids=tokens)
        assert int(dropped) == 0
        cache = runner.cache
        t = 0
        for s, c in zip(seqs, counts):
            for i in range(LAYERS):
                k, v = hist[s][i]
                hist[s][i] = [np.concatenate([k, stored(ks[i][t:t + c])]),
                              None if vs[i] is None else np.concatenate([v, stored(vs[i][t:t + c])])]
            t += c
        for i, g in enumerate(groups):
            q = rng.standard_normal((n, 2 * g.num_kv_heads, g.key_head_dim)).astype(np.float32)
            out = np.asarray(easykv.view_attention(q, cache.views[i], rts))
            t = 0
            for s, c in zip(seqs, counts):
                k, v = hist[s][i]
                pos = np.arange(len(k) - c, len(k))
                want = numpy_attention(q[t:t + c], k, k[..., :g.value_head_dim] if g.latent else v, pos,
                                       window=g.window if g.attention == "sliding" else None)
                tol = 3e-5 if quantizer == "none" else 2e-3  # int8 pages attend in f32 on the dequantized values
                np.testing.assert_allclose(out[t:t + c], want, rtol=tol, atol=tol, err_msg=f"layer {i} seq {s}")
                t += c
        return rts

    def empty():
        return [[np.zeros((0, g.num_kv_heads, g.key_head_dim), np.float32),
                 np.zeros((0, g.num_kv_heads, g.value_head_dim), np.float32) if g.has_values else None]
                for g in groups]

    prompts = [list(range(1, 15)), list(range(40, 49)), list(range(1, 13)) + [99, 98, 97]]
    seqs = []
    for p in prompts:
        [s] = m.claim(1)
        done = m.match_prefix(s, p)
        hist[s] = empty()
        if done:  # the hit's K/V are the first prompt's: the reference history starts with them
            assert (s, done) == (2, 12)
            hist[s] = [[k[:done], None if v is None else v[:done]] for k, v in hist[0]]
        step([s], [p[done:]])
        seqs.append(s)
    assert m.metrics.prefix_hit_tokens == 12
    child = m.fork(0)
    hist[child] = [[k.copy(), None if v is None else v.copy()] for k, v in hist[0]]
    seqs.append(child)
    for t in range(6):  # the sliding window moves over page boundaries; freed pages are taken again
        step(seqs, [[t]] * len(seqs))
        m.check_invariants()
    assert m.metrics.copies >= 3  # the fork's partial page was copied in each group
    assert max(sum(p != PAD for p in m.pages(s, group=0)) for s in seqs) <= 3  # window 6: at most 3 pages


def test_crafted_grouped_states_and_arguments_are_refused():
    m = PageManager(hybrid(full_pages=16, sliding_pages=8, shards=2))
    a, b = m.claim(2)
    grow(m, a, range(1, 10))
    grow(m, b, range(20, 25))
    state = json.loads(json.dumps(m.state_dict()))
    assert state["sequences"][1]["pages"] == [[8, 9], [4, 5]] and state["sequences"][1]["replica"] == 1

    def refused(edit, field, words):
        bad = json.loads(json.dumps(state))
        edit(bad)
        with pytest.raises(ManagerStateError, match=words) as err:
            PageManager.from_state_dict(m.metadata, bad)
        assert err.value.field.startswith(field), err.value.field

    # one replica per sequence, for the pages of every group
    refused(lambda s: s["sequences"][1].update(replica=0), "sequences",
            "holds a page in layer group 0 outside its data-parallel replica's slice")
    refused(lambda s: s["config"].update(groups=s["config"]["groups"][:1]), "config.groups", "1 entries for 2")
    refused(lambda s: s["config"]["groups"][0].update(window=4), "config", "another pool")
    refused(lambda s: s["sequences"][0]["pages"][0].__setitem__(0, PAD), "sequences[id=0].pages",
            "released its first 1 pages in layer group 0, but its window releases exactly 0")
    before = m.state_dict()
    for bad in (True, -1, 2, "0", 1.0):
        with pytest.raises(ValueError, match="group"):
            m.pages(a, group=bad)
    with pytest.raises(ValueError, match="must be the PagedAttentionCache of this manager's pool, got SimpleNamespace"):
        easykv.apply_pending(m, __import__("types").SimpleNamespace(  # a look-alike is no cache
            metadata=hybrid(full_pages=16, sliding_pages=16, shards=2), copy_pages=lambda *a: None))
    assert m.state_dict() == before
