"""The hypothesis state machines shared by the manager and host-tier tests, and the simulated
device they check pages on: each page holds the token ids written into it, copied and scrubbed
as an engine applies the manager's pending work. Example counts come from the Hypothesis
profile (tests/conftest.py), never from here."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from easykv.errors import CacheFullError
from easykv.manager.manager import PageManager
from tests.support.managers import PS, make_meta


class Device:
    """Pages of token ids per layer group, written and copied as the manager says (the K/V
    stand-in). ``pages``: the pool of each group (an int for a one-group manager)."""

    def __init__(self, pages):
        self.grouped = not isinstance(pages, int)
        self.stores = [np.full((n, PS), -1, np.int64) for n in (pages if self.grouped else [pages])]

    def apply(self, work):
        """Run a `DeviceWork` (a plan's, or what `take_work` handed over) on the stores."""
        src, dst = work.copies()
        for store, s, d, z in zip(self.stores, src, dst, work.scrubs(), strict=True):
            store[d] = store[s].copy()  # every source read before any destination is written
            store[z] = -1

    def write(self, step_meta, tokens):
        for store, meta in zip(self.stores, step_meta, strict=True):
            slots = np.asarray(meta.slot_mapping)[: len(tokens)]
            assert (slots >= 0).all()
            store.reshape(-1)[slots] = tokens

    def run(self, pm, seq, tokens):
        """One step of ``seq`` writing ``tokens``, as an engine runs it."""
        plan = pm.schedule([seq], [len(tokens)])
        self.apply(plan.work)
        self.write(plan.metadata, tokens)
        pm.commit(plan, [list(tokens)])

    def views(self, pm):
        """The stores as they will be once the pending copies and scrubs are applied (read from a
        clone's work, so the manager's own stays pending)."""
        work = pm.clone().take_work()
        src, dst = work.copies()
        out = []
        for store, s, d, z in zip(self.stores, src, dst, work.scrubs(), strict=True):
            view = store.copy()
            view[d] = store[s]
            view[z] = -1
            out.append(view)
        return out

    def tokens(self, pm, seq, group=None):
        """The sequence's tokens as its pages in ``group`` hold them, from the first position it
        keeps there (0 but in a sliding window)."""
        g = 0 if group is None else group
        store, pages, n = self.views(pm)[g], pm.pages(seq, group=group), pm.length(seq)
        first = pm.sequence(seq).first_kept[g]
        return [int(store[pages[i // PS], i % PS]) for i in range(first, n)]


PROMPTS = [tuple(range(9)), tuple(range(6)) + (9, 9, 9), (5,) * 7, tuple(range(13))]


class TruncateMachine(RuleBasedStateMachine):
    """``grouped``: a manager of a full group and a sliding one (window 6, its own pool)."""

    grouped = False

    def __init__(self):
        super().__init__()
        if self.grouped:
            from easykv import LayerGroup
            from easykv.spec.metadata import PagedAttentionCacheMetaData

            groups = (LayerGroup((0,), "sliding", 6, num_pages=12), LayerGroup((1,), num_pages=16))
            meta = PagedAttentionCacheMetaData(batch_size=6, num_hidden_layers=2, num_pages_per_layer=16,
                                               num_pages_per_sequence=5, max_sequences=20, page_size=PS,
                                               num_kv_heads=2, kv_head_dim_size=8, hbm_utilization=0.9,
                                               layer_groups=groups)
            self.pm, self.dev = PageManager(meta, scrub_released=True), Device([12, 16])
        else:
            self.pm, self.dev = PageManager(make_meta(batch=6, pages=16, max_len=20), scrub_released=True), Device(16)
        self.model: dict[int, list[int]] = {}

    @precondition(lambda self: len(self.model) < 6)
    @rule(prompt=st.sampled_from(PROMPTS))
    def admit(self, prompt):
        [s] = self.pm.claim(1)
        done = self.pm.match_prefix(s, list(prompt))
        try:
            plan = self.pm.schedule([s], [len(prompt) - done])
        except CacheFullError:
            self.pm.release(s)
            return
        self.dev.apply(plan.work)
        self.dev.write(plan.metadata, prompt[done:])
        self.pm.commit(plan, [list(prompt[done:])])
        self.model[s] = list(prompt)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), token=st.integers(0, 3), n=st.integers(1, 5))
    def extend(self, data, token, n):
        s = data.draw(st.sampled_from(sorted(self.model)))
        n = min(n, 20 - len(self.model[s]))
        if not n:
            return
        tokens = [token + i for i in range(n)]
        try:
            plan = self.pm.schedule([s], [n])
        except CacheFullError:
            return
        self.dev.apply(plan.work)
        self.dev.write(plan.metadata, tokens)
        self.pm.commit(plan, [tokens])
        self.model[s] += tokens

    @precondition(lambda self: self.model and len(self.model) < 6)
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data, n):
        s = data.draw(st.sampled_from(sorted(self.model)))
        n = min(n, 6 - len(self.model))
        for child in self.pm.fork(s, n):
            self.model[child] = list(self.model[s])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data):
        s = data.draw(st.sampled_from(sorted(self.model)))
        length = data.draw(st.integers(0, len(self.model[s])))
        before = self.pm.state_dict()
        try:
            self.pm.truncate(s, length)
        except CacheFullError:
            assert self.pm.state_dict() == before
            return
        except ValueError as err:  # only a window that released what the length needs refuses
            assert self.grouped and "window released" in str(err), err
            assert self.pm.state_dict() == before
            return
        del self.model[s][length:]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data):
        s = data.draw(st.sampled_from(sorted(self.model)))
        self.pm.release(s)
        del self.model[s]

    @rule(version=st.sampled_from([None, 1]))
    def set_version(self, version):
        self.pm.set_weight_version(version)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        self.pm.check_invariants()
        for s, tokens in self.model.items():
            for g in range(self.pm.num_groups):
                group = g if self.grouped else None
                first = self.pm.sequence(s).first_kept[g]
                assert self.dev.tokens(self.pm, s, group) == tokens[first:], (s, g)


class GroupedTruncateMachine(TruncateMachine):
    grouped = True


class VersionMachine(RuleBasedStateMachine):
    """Sequences of a few prompts (sharing prefixes) claimed, written, decoded and released while
    the weight version changes; every prefix hit must be a prefix some sequence wrote under the
    lookup's version (the model), and the manager's invariants hold after every step."""

    def __init__(self):
        super().__init__()
        self.pm = PageManager(make_meta(batch=4, pages=12, max_len=16))
        self.version = None
        self.written: set[tuple] = set()  # (version, tokens of full pages) some sequence filled
        self.live: dict[int, tuple] = {}  # seq -> (version, tokens so far)

    @rule(version=st.sampled_from([None, 1, 2, "2"]))
    def set_version(self, version):
        self.pm.set_weight_version(version)
        self.version = version
        for s, (_, tokens) in self.live.items():
            if not tokens:  # not started: takes the new version
                self.live[s] = (version, tokens)

    @precondition(lambda self: len(self.live) < 4)
    @rule(prompt=st.sampled_from([(1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 3, 4, 9, 9, 9, 9, 9), (5,) * 6, (1, 2, 3, 4, 5)]))
    def admit(self, prompt):
        [s] = self.pm.claim(1)
        free = self.pm.metrics.free_pages + self.pm.metrics.cached_pages
        hit = self.pm.cached_prefix_length(list(prompt))
        if -(-len(prompt) // PS) - hit // PS > free:
            self.pm.release(s)
            return
        done = self.pm.match_prefix(s, list(prompt))
        assert done == hit
        for k in range(1, done // PS + 1):
            assert (self.version, prompt[: k * PS]) in self.written, (self.version, prompt[: k * PS])
        try:
            plan = self.pm.schedule([s], [len(prompt) - done])
        except CacheFullError:  # the hit's pages were among those counted as available
            self.pm.release(s)
            return
        self.pm.commit(plan, [list(prompt[done:])])
        self.live[s] = (self.version, tuple(prompt))
        self._record(s)

    @precondition(lambda self: any(t for _, t in self.live.values()))
    @rule(data=st.data())
    def decode(self, data):
        s = data.draw(st.sampled_from(sorted(s for s, (_, t) in self.live.items() if t)))
        v, tokens = self.live[s]
        if len(tokens) >= 16 or (len(tokens) % PS == 0
                                 and self.pm.metrics.free_pages + self.pm.metrics.cached_pages == 0):
            return
        self.pm.commit(self.pm.schedule([s], [1]), [7])
        self.live[s] = (v, tokens + (7,))
        self._record(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        s = data.draw(st.sampled_from(sorted(self.live)))
        self.pm.release(s)
        del self.live[s]

    @rule()
    def reset(self):
        self.pm.reset_prefix_cache()
        self.written.clear()  # nothing cached any more; what is filled from now on counts again

    def _record(self, s):
        v, tokens = self.live[s]
        for k in range(1, len(tokens) // PS + 1):
            self.written.add((v, tokens[: k * PS]))

    @invariant()
    def consistent(self):
        self.pm.check_invariants()
        for m in self.pm.metrics.versions:
            assert m.current == (m.version == self.version)
