"""One step form inside (issue 43): `RaggedStep` is the only form the core knows; EasyDeL's
`PagedAttentionMetadata` is the edge.

* the page manager's plans hold `RaggedStep`s, six arrays (no shape-() "absent" fields travel
  into a jitted step or a device loop), which the write and attention take as they are;
* EasyDeL's forms are converted where they enter, once per step (not once per layer), and only
  ``step/metadata.py`` knows their fields;
* the jitted step is the same program from either class, and EasyDeL's class keeps what its
  seed documents (its JSON byte for byte, ``is_*_mode``, the views' ``write_*_to_cache``);
* bad input (another class, a form a call cannot take, a proof written by hand) is refused by
  name, before anything is written.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from easykv import PagedAttentionCacheMetaData, PagedAttentionMetadata, PageManager
from easykv.attention.api import paged_attention, view_attention
from easykv.step import checks as step_checks
from easykv.step.checks import HostChecked, host_checked, mark_checked
from easykv.step.metadata import as_mixed, group_runtime, step_form
from easykv.step.ragged import RAGGED_FIELDS, RaggedStep, increment_cache_lengths, stack_metadata
from easykv.storage.writes import token_slots
from tests.support.pools import LAYERS, bits, new_cache, random_tokens, setup, snapshot

ROOT = pathlib.Path(__file__).resolve().parents[2]
META = PagedAttentionCacheMetaData(
    batch_size=4, num_hidden_layers=1, num_pages_per_layer=12, num_pages_per_sequence=4,
    max_sequences=16, page_size=4, num_kv_heads=2, kv_head_dim_size=8, hbm_utilization=0.9,
)  # fmt: skip
TABLE = np.array([[3, 7, -1, -1], [0, 1, 2, -1]], np.int32)


def _planned(meta=META, new=(1, 2)):
    m = PageManager(meta)
    seqs = m.claim(len(new))
    for s, cached in zip(seqs, (5, 9)):
        m.commit(m.schedule([s], [cached]), [list(range(1, cached + 1))])
    return m, m.schedule(seqs, list(new))


def test_the_page_managers_steps_are_ragged_steps_of_six_arrays():
    m, plan = _planned()
    (step,) = plan.metadata
    assert type(step) is RaggedStep and step_form(step) == "mixed"
    assert [f.name for f in dataclasses.fields(step)] == list(RAGGED_FIELDS)
    assert len(jax.tree.leaves(step)) == 6 and all(np.ndim(leaf) > 0 for leaf in jax.tree.leaves(step)[:-1])
    assert host_checked(step) is step.checked is not None  # proved by the manager, its arrays read-only
    assert step.num_tokens == 3 and step.positions.tolist() == [5, 9, 10]
    # the next decode step and a stack of steps stay in the core's class
    m.abort(plan)
    decode = m.schedule_decode([0, 1], 2)
    nxt = increment_cache_lengths(decode.metadata[0], page_size=4)
    assert type(nxt) is RaggedStep and nxt.checked is None and nxt.positions.tolist() == [6, 10]
    stacked = stack_metadata([decode.metadata[0], nxt])
    assert type(stacked) is RaggedStep and stacked.positions.tolist() == [[5, 9], [6, 10]]


def test_easydels_class_carries_a_ragged_step_and_back():
    _, plan = _planned()
    (step,) = plan.metadata
    seed = PagedAttentionMetadata.from_ragged(step)
    assert seed.is_mixed_mode() and not seed.is_decode_mode() and not seed.is_prefill_mode()
    assert all(getattr(seed, f) is getattr(step, f) for f in RAGGED_FIELDS)  # the same arrays: nothing copied
    assert seed.checked == step.checked and host_checked(seed) is not None
    entry = as_mixed(seed, page_size=4)
    assert type(entry.step_meta) is RaggedStep and entry.proof == step.checked
    assert all(getattr(entry.step_meta, f) is getattr(step, f) for f in RAGGED_FIELDS)
    # the write and attention take either class, with the same result
    k, v = (np.random.default_rng(s).standard_normal((2, 12, 4, 8)).astype(np.float32) for s in (1, 2))
    q = np.random.default_rng(3).standard_normal((3, 4, 8)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(paged_attention(q, k, v, step)), np.asarray(paged_attention(q, k, v,
                                                                                                         seed)))
    np.testing.assert_array_equal(token_slots(step, META), token_slots(seed, META))
    with pytest.raises(ValueError, match=r"from_ragged takes a RaggedStep \(the page manager's plan.metadata item\), "
                                         r"got PagedAttentionMetadata"):
        PagedAttentionMetadata.from_ragged(seed)


def test_easydels_forms_are_converted_once_per_step_not_per_layer(monkeypatch):
    """A decode step of EasyDeL's form written and attended layer after layer: its fields are
    checked and converted on the first layer (once for the write's pool, once for attention's,
    which knows no sequence limit), and the next layers reuse those conversions."""
    cache = new_cache("heads")
    _, _, meta = setup("heads")
    step = PagedAttentionMetadata.for_decode([[0, 1, -1, -1], [2, -1, -1, -1]], [4, 1], cache_metadata=meta)
    calls = []
    real = step_checks.check_decode_fields
    monkeypatch.setattr(step_checks, "check_decode_fields", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(0)
    heads = meta.num_kv_heads
    per_layer = []
    for layer in range(LAYERS):
        k, v = (jnp.asarray(random_tokens(rng, (2, heads, 8))) for _ in range(2))
        view = cache.views[layer].write_decodes_to_cache(k, v, step)
        cache.views[layer] = view
        view_attention(jnp.asarray(random_tokens(rng, (2, heads, 8))), view, step)
        per_layer.append(len(calls))
    assert per_layer == [2, 2]  # the second layer converts nothing
    # a copy with writable arrays carries no proof: nothing to rely on, so converted (and checked) per call
    unproved = step.replace(decodes_position=np.array([4, 1], np.int32))
    as_mixed(unproved, page_size=4), as_mixed(unproved, page_size=4)
    assert len(calls) == 4


def test_only_step_metadata_knows_easydels_fields():
    """No module but ``step/metadata.py`` reads EasyDeL's forms (its fields and mode predicates):
    everything else reads the ragged form, converted there."""
    easydel_only = {"decodes_position", "decodes_page_table", "prefill_length", "prefill_position",
                    "prefill_page_table", "is_decode_mode", "is_prefill_mode", "is_mixed_mode"}
    found = []
    for path in sorted((ROOT / "easykv").rglob("*.py")):
        if path.relative_to(ROOT).as_posix() == "easykv/step/metadata.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else None
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) > 1:
                picked = node.args[1]
                if isinstance(picked, ast.Constant):
                    name = picked.value
                elif isinstance(picked, ast.JoinedStr) and "_mode" in ast.unparse(picked):
                    name = "is_*_mode"  # a mode predicate picked by name: getattr(step, f"is_{mode}_mode")
            if name in easydel_only or name == "is_*_mode":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not found, "EasyDeL's forms read outside step/metadata.py:\n" + "\n".join(found)


def test_the_jitted_step_is_the_same_program_from_either_class():
    """The engine's step (every layer's write, then each layer's attention) lowers to the same
    program from the plan's RaggedSteps and from EasyDeL's class over the same arrays: the edge
    adds nothing to the program, and no absent field becomes an argument."""
    cache = new_cache("heads")
    _, _, meta = setup("heads")
    m = PageManager(meta)
    seqs = m.claim(2)
    plan = m.schedule(seqs, [5, 3], pad_tokens_to=8, pad_seqs_to=2)
    heads = meta.num_kv_heads
    keys = jnp.zeros((LAYERS, 8, heads, 8), jnp.bfloat16)
    q = jnp.zeros((8, heads, 8), jnp.bfloat16)

    def step(cache, keys, q, metadata):
        cache, dropped = cache.write(keys, keys, metadata)
        return cache, dropped, [view_attention(q, cache.views[i], metadata) for i in range(LAYERS)]

    lowered = jax.jit(step, donate_argnums=0).lower
    ragged = lowered(cache, keys, q, plan.metadata).as_text()
    seed = lowered(cache, keys, q, tuple(PagedAttentionMetadata.from_ragged(s) for s in plan.metadata)).as_text()
    assert ragged == seed
    assert ragged.count("tensor<i32>") == seed.count("tensor<i32>")


def test_easydels_json_is_byte_for_byte_what_it_was():
    """to_json of every form, pinned to the bytes easykv wrote before the ragged form had a class."""
    steps = {"mixed": PagedAttentionMetadata.for_mixed(TABLE, [5, 9], [1, 2], cache_metadata=META, pad_tokens_to=4),
             "decode": PagedAttentionMetadata.for_decode(TABLE, [5, 10], cache_metadata=META),
             "prefill": PagedAttentionMetadata.for_prefill(TABLE[1], 3, start=8, padded_length=5, cache_metadata=META),
             "empty": PagedAttentionMetadata.init_empty()}
    pinned = {"mixed": "3fd29d691be8dd33cdb815b9b05f35e15fd1161f6d4b72d57d0f37a173f0cd74",
              "decode": "a97f632484b0caf5e9e86e3cfbe74710ea4714b6eb5b4a25a6ee708d6d18cd53",
              "prefill": "7b6541be819c3b55a621b1fa3b5b0642e29ed7d10d869fbc363457781cc51a82",
              "empty": "418aed32224c1967ac98ef261d87c304a2039effd1380c4a886e1f5be22908ac"}
    for form, step in steps.items():
        text = step.to_json()
        assert hashlib.sha256(text.encode()).hexdigest() == pinned[form], form
        assert PagedAttentionMetadata.from_json(text).to_json() == text
    assert '"decodes_position": {"__ndarray__": "BQAAAAoAAAA=", "dtype": "int32", "shape": [2]}' in steps[
        "decode"].to_json()


def test_a_ragged_step_checks_its_values_on_request():
    _, plan = _planned()
    (step,) = plan.metadata
    step.check_values(META)
    jax.tree.map(jnp.asarray, step).check_values(META)  # device arrays: pulled to the host, all checked
    holed = mark_checked(step.replace(page_table=np.where(np.arange(4) == 1, -1, step.page_table)), step.checked)
    with pytest.raises(ValueError, match=r"metadata.page_table\[0, 1\] = -1 is no page \(never assigned, or released "
                                         r"when it left a sliding or chunked window\) but row 0 reads it"):
        holed.check_values(META)
    with pytest.raises(ValueError, match=r"token 0 would be written to slot 48, outside the pool's 48 slots"):
        step.replace(slot_mapping=np.array([48, 1, 2], np.int32)).check_values(META)
    with pytest.raises(ValueError, match=r"check_values reads the step's values: call it outside jit"):
        jax.jit(lambda s: s.check_values(META))(step)


def test_a_call_given_a_form_it_cannot_take_is_refused_by_name_and_writes_nothing():
    cache = new_cache("heads")
    _, _, meta = setup("heads")
    m = PageManager(meta)
    seqs = m.claim(2)
    plan = m.schedule(seqs, [1, 1])
    heads = meta.num_kv_heads
    k = jnp.asarray(random_tokens(np.random.default_rng(0), (2, heads, 8)))
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"write_decodes_to_cache needs decode metadata "
                                         r"\(PagedAttentionMetadata.for_decode\)"):
        cache.views[0].write_decodes_to_cache(k, k, plan.metadata)
    with pytest.raises(ValueError, match=r"write_prefill_to_cache needs prefill metadata"):
        cache.views[0].write_prefill_to_cache(k, k, plan.metadata[0])
    with pytest.raises(ValueError, match=r"step metadata must be a RaggedStep or a PagedAttentionMetadata \(or one "
                                         r"per layer group\), got dict"):
        cache.views[0].write_mixed_to_cache(k, k, {"slot_mapping": np.array([0, 1])})
    with pytest.raises(ValueError, match=r"the step metadata holds 2 item\(s\) but the cache has 1 layer group\(s\); "
                                         r"give one step per group \(the plan's plan.metadata\)"):
        cache.write(k[None].repeat(LAYERS, 0), k[None].repeat(LAYERS, 0), plan.metadata * 2)
    for view, (key, value) in zip(cache, before):
        assert np.array_equal(bits(view.key_pages), bits(key)) and np.array_equal(bits(view.value_pages), bits(value))
    # the manager's step writes as the mixed form, through the view and through the cache
    view = cache.views[0].write_mixed_to_cache(k, k, plan.metadata)
    assert not np.array_equal(bits(view.key_pages), bits(before[0][0]))


def test_ragged_functions_refuse_what_is_not_the_ragged_form():
    decode = PagedAttentionMetadata.for_decode(TABLE, [5, 10], cache_metadata=META)
    for bad, name in ((decode, "PagedAttentionMetadata"), (object(), "object"), ({"slot_mapping": 1}, "dict")):
        with pytest.raises(ValueError, match=rf"increment_cache_lengths takes a decode step in the ragged form \(a "
                                             rf"RaggedStep: the page manager's plan.metadata item, or "
                                             rf"PagedAttentionMetadata.for_mixed\), got {name}$"):
            increment_cache_lengths(bad, page_size=4)
    mixed = PagedAttentionMetadata.for_mixed(TABLE, [5, 9], [1, 1], cache_metadata=META)
    nxt = increment_cache_lengths(mixed, page_size=4)  # EasyDeL's mixed form is the ragged form: its class is kept
    assert type(nxt) is PagedAttentionMetadata and nxt.positions.tolist() == [6, 10]
    with pytest.raises(ValueError, match=r"the step metadata must be a RaggedStep or a PagedAttentionMetadata, got "
                                         r"tuple"):
        as_mixed((mixed,), page_size=4)
    with pytest.raises(ValueError, match=r"step metadata must be a RaggedStep or a PagedAttentionMetadata \(or one "
                                         r"per layer group\), got NoneType"):
        group_runtime(None, 1, 0)


def test_a_ragged_steps_proof_is_its_builders_alone():
    _, plan = _planned()
    (step,) = plan.metadata
    fields = {f: getattr(step, f) for f in RAGGED_FIELDS}
    assert RaggedStep(**fields, proof=step.checked).checked is step.checked  # the very arrays: it carries
    refused = r"proof= carries the proof of another step's arrays \(or of none\)"
    with pytest.raises(ValueError, match=refused):  # written by hand: issued for no arrays
        RaggedStep(**fields, proof=HostChecked(num_pages=12, page_size=4, reads=True, page_shards=1))
    with pytest.raises(ValueError, match=refused):  # equal values, other arrays
        RaggedStep(**{**fields, "page_table": step.page_table.copy()}, proof=step.checked)
    seed = PagedAttentionMetadata.from_ragged(step)
    with pytest.raises(ValueError, match=refused):  # a proof of six arrays is no proof of EasyDeL's eleven
        PagedAttentionMetadata(**fields, proof=step.checked)
    with pytest.raises(ValueError, match=r"proof must be a HostChecked \(what a validated constructor proved\), got "
                                         r"str"):
        RaggedStep(**fields, proof="checked")
    assert seed.checked == step.checked and step.replace().checked is None and host_checked(step.replace()) is None
