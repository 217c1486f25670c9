"""End to end: the PageManager drives a real PagedAttentionCache on 8 simulated devices.

Sequences share a prompt prefix, fork and diverge; every K/V written through a plan's
metadata (after applying the plan's page copies and scrubs) must read back exactly with gather_kv,
for every sequence and layer, on a head-sharded pool and on a data-parallel pool.
"""

from __future__ import annotations

import numpy as np
import pytest

from easykv.manager.manager import PageManager
from easykv.runner import apply_pending
from easykv.storage.cache import gather_kv
from tests.support.pools import HEAD_DIM, LAYERS, bits, new_cache, random_tokens, setup


def padded(pages, size):
    """Each group's page ids padded with -1 (ignored) to ``size``: fixed shapes, one compile."""
    return tuple(np.concatenate([ids, np.full(size - ids.size, -1, np.int32)]) for ids in pages)


class Engine:
    """The smallest engine loop: plan -> its page ops -> one write per step, with the K/V each
    sequence should hold kept per position (bit patterns) for the read-back."""

    def __init__(self, layout: str):
        _, _, self.meta = setup(layout)
        self.cache = new_cache(layout)
        self.pm = PageManager(self.meta, scrub_released=True)
        self.rng = np.random.default_rng(0)
        self.want: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def run(self, plan, seqs, counts):
        """Apply the plan's work, then write each of its steps; sequence ``seqs[i]`` appends ``counts[i]`` tokens
        per step."""
        src, dst = plan.work.copies()
        self.cache = self.cache.copy_pages(padded(src, 4), padded(dst, 4))
        self.cache = self.cache.zero_pages(padded(plan.work.scrubs(), 8))
        meta = plan.metadata
        for step in range(plan.num_steps):
            meta = plan.next_metadata(meta) if step else meta
            n, heads = meta[0].num_tokens, self.meta.num_kv_heads  # one metadata per layer group
            keys = random_tokens(self.rng, (LAYERS, n, heads, HEAD_DIM))
            values = random_tokens(self.rng, (LAYERS, n, heads, HEAD_DIM))
            self.cache, dropped = self.cache.write(keys, values, meta)
            assert int(dropped) == 0
            t = 0
            for seq, c in zip(seqs, counts):
                for _ in range(c):
                    self.want[seq].append((bits(keys)[:, t], bits(values)[:, t]))
                    t += 1

    def prefill(self, seq, prompt):
        done = self.pm.match_prefix(seq, prompt)
        plan = self.pm.schedule([seq], [len(prompt) - done], pad_tokens_to=16)
        self.run(plan, [seq], [len(prompt) - done])
        self.pm.commit(plan, [prompt[done:]])
        return done

    def check(self):
        self.pm.check_invariants()
        for seq, tokens in self.want.items():
            n, row = self.pm.length(seq), np.asarray(self.pm.page_table([seq])[0])
            assert n == len(tokens)
            for layer in range(LAYERS):
                k, v = gather_kv(self.cache, layer, row, n)
                assert np.array_equal(bits(k), np.stack([t[0][layer] for t in tokens]))
                assert np.array_equal(bits(v), np.stack([t[1][layer] for t in tokens]))


@pytest.mark.parametrize("layout", ["heads", "dp"])
def test_shared_then_diverging_sequences_read_back_exactly(layout):
    eng = Engine(layout)
    pm = eng.pm
    prompt = list(range(10))
    a, b = pm.claim(2)
    eng.want[a] = []
    assert eng.prefill(a, prompt) == 0
    eng.want[b] = list(eng.want[a][:8])  # b reuses a's first two pages
    assert eng.prefill(b, prompt) == 8 and pm.pages(b)[:2] == pm.pages(a)[:2]
    c = pm.fork(a)  # shares a's partly filled third page
    eng.want[c] = list(eng.want[a])
    eng.check()

    plan = pm.schedule([c, a, b], [1, 2, 1])  # c copies the shared page first
    assert plan.work.num_copies == 1
    eng.run(plan, [c, a, b], [1, 2, 1])
    pm.commit(plan, [[50], [60, 61], [70]])
    assert pm.pages(a)[2] != pm.pages(c)[2]
    eng.check()

    plan = pm.schedule_decode([a, c], 3)  # multi-step decode, pages reserved ahead
    eng.run(plan, [a, c], [1, 1])
    pm.commit(plan, np.array([[1, 2, 3], [4, 5, 6]]))
    eng.check()

    pm.release(b)  # scrubbed pages must not touch the survivors
    del eng.want[b]
    [d] = pm.claim(1)
    eng.want[d] = list(eng.want[a][:8])
    assert eng.prefill(d, prompt + [9, 9]) == 8
    eng.check()
    if layout == "dp":
        assert pm.sequence(a).replica == pm.sequence(c).replica == pm.sequence(d).replica


def test_apply_pending_with_a_donated_cache_applies_nothing_and_keeps_the_work():
    """A stale cache (donated to an earlier call) must not swallow the copy-on-write copies:
    the retry with the live cache still copies, and the fork reads its own tokens."""
    eng = Engine("heads")
    [a] = eng.pm.claim(1)
    eng.want[a] = []
    eng.prefill(a, list(range(6)))
    b = eng.pm.fork(a)
    eng.want[b] = list(eng.want[a])
    eng.pm.truncate(b, 5)  # b will write again into the shared partial page: a copy is pending
    stale = eng.cache
    eng.cache = eng.cache.zero_pages(np.full(8, -1, np.int32))  # donates `stale`
    before = eng.pm.state_dict()
    with pytest.raises(ValueError, match="donated to an earlier call"):
        apply_pending(eng.pm, stale)
    assert eng.pm.state_dict() == before and eng.pm.has_pending_work
    eng.cache, copied = apply_pending(eng.pm, eng.cache)
    assert copied == 1 and not eng.pm.has_pending_work
    for layer in range(LAYERS):
        for seq, n in ((a, 6), (b, 5)):
            k, _ = gather_kv(eng.cache, layer, np.asarray(eng.pm.pages(seq)), n)
            assert np.array_equal(bits(k), np.stack([w[0][layer] for w in eng.want[seq][:n]]))
