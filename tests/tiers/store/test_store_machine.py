"""A Hypothesis machine: three caches on different meshes (tp=8, dp=2 x tp=4, one device) share one
``memory://`` store (write_through, write_through, write_back): random prompts with shared prefixes, decodes,
releases, evictions (small pools), weight version changes, store wipes and damaged values. After every step
each sequence's pages hold exactly its own tokens' K/V, every manager's invariants hold, and every value in
the store holds exactly the K/V of the page its key names (or is one the machine damaged, and refused;
a reader deletes a value it refuses, so a writer may have written the key again since)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from easykv.errors import CacheFullError
from easykv.tiers.store import PrefixStore, codec, open_backend
from tests.tiers.store.harness import HEADS, PS, Replica, kv_of

BASES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [50, 51, 52, 53, 54, 55, 56, 57])
# layout, write, read, device pages, host pages: small pools, so pages move down the tiers and out
SETUPS = (("tp8", "write_through", "wait", 12, 4), ("dp2tp4", "write_through", "best_effort", 16, 4),
          ("one", "write_back", "wait", 6, 2))


class SharedStoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.backend = open_backend(f"memory://{uuid.uuid4().hex}")
        self.replicas = [Replica(layout, PrefixStore(self.backend, model_id="test/model", write=write, read=read,
                                                     retry_s=0.0), pages=pages, host_pages=host, max_len=24)
                         for layout, write, read, pages, host in SETUPS]
        self.started: list[dict[int, object]] = [{} for _ in self.replicas]  # seq -> weight version it began on
        self.pages: dict[bytes, tuple[list[int], int]] = {}  # digest -> (its tokens, first position)
        self.damaged: set[str] = set()

    def _record(self):
        """The digest of every full page of every sequence begun on its replica's current version."""
        for replica, started in zip(self.replicas, self.started):
            for seq, tokens in replica.tokens.items():
                if started.get(seq, "?") == replica.manager.weight_version:
                    for i, d in enumerate(replica.manager.prompt_digests(list(tokens) + [0])):
                        self.pages[d] = (tokens[PS * i: PS * (i + 1)], PS * i)

    @initialize(writer=st.integers(0, 2), reader=st.integers(0, 2), base=st.integers(0, 1))
    def shared_opening(self, writer, reader, base):
        """Every run starts with one replica reading what another wrote."""
        tokens = BASES[base] + [100, 101, 102]
        self._prefill(writer, tokens)
        self.replicas[writer].store.flush(10)
        self._prefill(reader, tokens)

    def _prefill(self, r, tokens):
        replica = self.replicas[r]
        if len(replica.tokens) >= 2:  # room for the new one in the small pools
            replica.release(min(replica.tokens))
        if r == 1:
            replica.runner.prefetch(tokens)
        try:
            seq, _ = replica.prefill(tokens)
            self.started[r][seq] = replica.manager.weight_version
            self._record()
        except CacheFullError:  # the pool is small: the new sequence goes again, nothing else changed
            [seq] = [s for s in replica.manager.active_ids if s not in replica.tokens]
            replica.manager.release(seq)

    @rule(r=st.integers(0, 2), base=st.integers(0, 1), keep=st.sampled_from([12, 12, 9, 5, 0]),
          tail=st.lists(st.integers(100, 103), max_size=8))
    def prefill(self, r, base, keep, tail):
        tokens = BASES[base][:keep] + tail
        if tokens:
            self._prefill(r, tokens)

    @rule(r=st.integers(0, 2), first=st.integers(0, 7))
    def churn(self, r, first):
        """Prompts of their own, each released: the small pools evict (device -> host -> the store)."""
        for i in range(first, first + 3):
            self._prefill(r, [200 + 16 * (i % 8) + j for j in range(9)])
            self.replicas[r].release(max(self.replicas[r].tokens))

    @precondition(lambda self: any(r.tokens for r in self.replicas))
    @rule(src=st.integers(0, 2), dst=st.integers(0, 2), pick=st.integers(0, 1), extra=st.integers(0, 3))
    def share(self, src, dst, pick, extra):
        """Another replica's prompt (what it wrote is in the store by now), longer or shorter."""
        replica = self.replicas[src]
        if not replica.tokens:
            return
        replica.store.flush(10)
        tokens = replica.tokens[sorted(replica.tokens)[pick % len(replica.tokens)]]
        self._prefill(dst, (tokens + [101] * extra)[: 22])

    @precondition(lambda self: any(r.tokens for r in self.replicas))
    @rule(r=st.integers(0, 2), pick=st.integers(0, 1), token=st.integers(100, 103))
    def decode(self, r, pick, token):
        replica = self.replicas[r]
        if not replica.tokens:
            return
        seq = sorted(replica.tokens)[pick % len(replica.tokens)]
        if len(replica.tokens[seq]) < 23:
            try:
                replica.decode(seq, token)
                self._record()
            except CacheFullError:
                pass

    @precondition(lambda self: any(r.tokens for r in self.replicas))
    @rule(r=st.integers(0, 2), pick=st.integers(0, 1))
    def release(self, r, pick):
        replica = self.replicas[r]
        if replica.tokens:
            replica.release(sorted(replica.tokens)[pick % len(replica.tokens)])

    @rule(r=st.integers(0, 2), version=st.integers(0, 1))
    def weight_version(self, r, version):
        self.replicas[r].manager.set_weight_version(version)

    @rule()
    def wipe_store(self):
        for replica in self.replicas:
            replica.store.flush(10)
        self.backend.delete_many(self.backend.list_keys())
        self.damaged.clear()

    @rule(pick=st.integers(0, 10 ** 6), kind=st.sampled_from(["flip", "truncate", "swap"]))
    def damage(self, pick, kind):
        for replica in self.replicas:
            replica.store.flush(10)
        keys = [key for key in self.backend.list_keys() if key not in self.damaged]  # (a second flip restores)
        if len(keys) < 2:
            return
        key, other = keys[pick % len(keys)], keys[(pick + 1) % len(keys)]
        value, other_value = self.backend.get_many([key, other])
        value = {"flip": value[:20] + bytes([value[20] ^ 1]) + value[21:], "truncate": value[:-1],
                 "swap": other_value}[kind]
        self.backend.delete_many([key])
        self.backend.put_if_absent([(key, value)])
        self.damaged.add(key)

    @invariant()
    def stored_values_hold_their_pages(self):
        for replica in self.replicas:
            replica.store.flush(10)
        store = self.replicas[0].store
        keys = self.backend.list_keys()
        for key in self.damaged - set(keys):  # refused by a reader, deleted (and maybe written again since)
            self.damaged.discard(key)
        for key, value in zip(keys, self.backend.get_many(keys)):
            if key in self.damaged:
                try:  # still the damaged value, or a good one written after a reader deleted it
                    codec.decode(key, value, store._expected_of(key))
                except codec.StoreValueError:
                    continue
                self.damaged.discard(key)
            k, v = codec.decode(key, value, store._expected_of(key))
            *_, digest, head = key.split("/")
            if bytes.fromhex(digest) not in self.pages:  # a sequence begun on an earlier version wrote it
                continue
            tokens, first = self.pages[bytes.fromhex(digest)]
            for layer in range(k.shape[0]):
                want = kv_of(tokens, first, layer, HEADS, k.shape[-1])[:, int(head)]
                np.testing.assert_array_equal(k[layer].view(np.float32), want, key)
                np.testing.assert_array_equal(v[layer].view(np.float32), -want, key)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for replica in self.replicas:
            replica.manager.check_invariants()
            for seq in replica.tokens:
                replica.check_own_tokens(seq)

    def teardown(self):
        for replica in self.replicas:
            replica.store.close()


TestSharedStore = SharedStoreMachine.TestCase
TestSharedStore.settings = settings(TestSharedStore.settings, max_examples=12, stateful_step_count=20)


@pytest.mark.slow
class TestSharedStoreLong(SharedStoreMachine.TestCase):
    settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
