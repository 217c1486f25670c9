"""The host tier's layer alone (no PageManager), over a table of ten device pages of four tokens and a
few host pages, with exact ids: its per-group part records, lists and retires transfers; a reset
strips pending offloads of their digests and drops onloads into freed pages; the window lookup
reads the host tier only when asked; and the rules the core writes once over every lower tier
(`LowerTiers`): the hit code, and evictions handed down in order."""

import numpy as np
import pytest

from easykv.manager.allocators import allocator_for
from easykv.manager.host_tier import HostTierLayer
from easykv.manager.tier_set import LowerTiers
from easykv.spec.groups import LayerGroup
from easykv.step.metadata import PAD_PAGE as PAD

pytestmark = pytest.mark.numpy_only

PS, POOL, BATCH, COLUMNS = 4, 10, 3, 6
DIGESTS = [bytes([i]) * 32 for i in range(6)]


def tiered(kind="full", window=None, *, host_pages=4):
    """A table of ``kind`` over ten device pages with the host tier below it (``host_pages`` pages):
    (the table, the host layer, its part of the group)."""
    table = allocator_for(LayerGroup((0,), kind, window, num_pages=POOL), index=0, grouped=False, page_size=PS,
                          batch_size=BATCH, pages_per_sequence=COLUMNS, page_shards=1, scrub_released=False)
    layer = HostTierLayer([table], [host_pages])
    table.set_tiers(LowerTiers([layer]))
    return table, layer, layer.parts[0]


def test_a_table_keeps_device_pages_only_and_asks_the_tiers_below():
    table, layer, part = tiered()
    assert not hasattr(table, "host") and not hasattr(table, "onloads") and not hasattr(table, "offloads")
    assert table.tiers == (layer,) and table.pool.keep_evicted
    table.set_tiers(LowerTiers())
    assert not table.pool.keep_evicted  # nothing below keeps what the pool evicts


def test_host_transfers_are_recorded_listed_and_retired_by_the_groups_part():
    table, layer, part = tiered()
    host = part.pool
    [page] = table.allocate(0, 1)
    table.pool.commit(page, DIGESTS[0])
    [h] = host.allocate(0, 1, overwritten=True)
    part.offload(h, page)
    [h2] = host.allocate(0, 1)
    host.commit(h2, DIGESTS[1])
    [dst] = table.allocate(0, 1)
    part.onload(dst, h2)  # the host page's digest enters the device's prefix map
    assert part.offloads == {h: (page, DIGESTS[0], None)} and part.onloads == {dst: h2}
    assert table.pool.digest_of(dst) == DIGESTS[1]
    assert layer.moving(0) == {page, dst} and layer.pending_into(0, dst) and not layer.pending_into(0, page)
    assert [a.tolist() for a in part.pending_transfers()] == [[page], [h], [h2], [dst], []]
    work = layer.take_work()  # handed over: counted as done
    assert work.name == "host" and [g.onload_dst.tolist() for g in work.groups] == [[dst]]
    assert part.offloads == {} and part.onloads == {} and layer.counters["offloaded_pages"] == 1
    assert host.digest_of(h) == DIGESTS[0] and host.num_cached() == 2 and host.num_used() == 0


def test_a_reset_strips_pending_offloads_of_their_digests_and_drops_onloads_into_freed_pages():
    table, layer, part = tiered()
    host = part.pool
    cached, used, waiting = table.allocate(0, 3)
    table.pool.commit(cached, DIGESTS[0])
    table.pool.commit(used, DIGESTS[1])
    table.pool.release([cached])
    [kept] = host.allocate(0, 1)
    host.commit(kept, DIGESTS[2])
    host.release([kept])
    [h] = host.allocate(0, 1, overwritten=True)
    part.offload(h, used)
    [into] = host.allocate(0, 1)
    host.commit(into, DIGESTS[3])
    part.onload(waiting, into)  # the onload's digest makes the device page a prefix page
    table.release_pages([waiting])  # cached, still waiting for its data
    assert part.onloads == {waiting: into}
    assert table.forget_prefixes() == 3  # the device's digests 0, 1, 3
    assert layer.forget_prefixes() == 2  # the host's 2, 3; the onload into the freed page dropped
    assert table.pool.digest_of(used) is None and table.pool.num_cached() == 0 and host.num_cached() == 0
    assert part.offloads == {h: (used, None, None)} and part.onloads == {}
    assert host.refcount.tolist() == [0, 1, 0, 0] and table.pool.refcount[:3].tolist() == [0, 1, 0]


def test_a_page_freed_or_copied_before_its_onload_ran_is_asked_of_the_tier_once():
    table, layer, part = tiered()
    [h] = part.pool.allocate(0, 1)
    part.pool.commit(h, DIGESTS[0])
    [page] = table.allocate(0, 1)
    part.onload(page, h)
    [dst] = table.allocate(0, 1)
    assert table.copy_into(dst, page)  # the copy is filled from the host page the onload reads
    assert part.onloads == {page: h, dst: h} and part.pool.refcount[h] == 2 and table.copies == {}
    assert table.awaits_data(dst) and table.awaits_data(page)
    table.release_pages([dst])  # freed: nobody will read what the onload brings
    assert part.onloads == {page: h} and part.pool.refcount[h] == 1


def test_the_window_lookup_counts_pages_of_the_host_tier_only_when_asked():
    table, layer, part = tiered("sliding", 6)
    pages = table.allocate(0, 1)  # device page 0 holds digest 4
    assert table.pool.commit(pages[0], DIGESTS[4])
    table.release_pages(pages)
    host_pages = part.pool.allocate(0, 2)
    for k, h in zip((3, 5), host_pages):
        assert part.pool.commit(h, DIGESTS[k])
    served, found = table.prefix_hits(DIGESTS, 0, tiers=True)
    assert (served.tolist(), found.tolist()) == ([False, False, False, False, True, True], [-1, -1, -1, -2, 0, -3])
    served, found = table.prefix_hits(DIGESTS, 0, tiers=False)
    assert (served.tolist(), found.tolist()) == ([False] * 6, [-1, -1, -1, -1, 0, -1])
    assert table.hit_row(np.array([-1, -1, -1, -2, 0, -3]), 6) == [PAD, PAD, PAD, PAD, 0, -3]


def test_the_hit_code_names_the_tier_and_its_page_below_every_device_page():
    one, two = LowerTiers([object()]), LowerTiers([object(), object()])
    assert [one.hit_code(0, h) for h in range(3)] == [-2, -3, -4]  # one tier: -2 - h
    codes = {(t, h): two.hit_code(t, h) for t in range(2) for h in range(3)}
    assert sorted(codes.values(), reverse=True) == list(range(-2, -8, -1))  # distinct, below PAD_PAGE
    assert all(two.split_code(code) == key for key, code in codes.items())


def test_evictions_go_down_in_order_so_a_host_page_a_drop_frees_serves_only_the_pages_after_it():
    """Host pages 0 (a swapped sequence's) and 1 (an onload's, digest B): all held. Evicted, in
    order: A (data), B (its onload never ran: no data), C (data). A finds no host page (dropped,
    counted); B's drop leaves host page 1 cached; C evicts it. Handling the drops first would have
    given host page 1 to A instead."""
    table, layer, part = tiered(host_pages=2)
    host = part.pool
    host.allocate(0, 1)  # host page 0: held
    [h] = host.allocate(0, 1)
    host.commit(h, DIGESTS[1])
    a, b, c = table.allocate(0, 3)
    part.onload(b, h)
    table.tiers.evicted(0, [(a, DIGESTS[0], None), (b, DIGESTS[1], None), (c, DIGESTS[2], None)])
    assert part.onloads == {} and part.dropped == 1
    assert part.offloads == {h: (c, DIGESTS[2], None)} and host.digest_of(h) is None  # evicted from the host
