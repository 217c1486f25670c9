"""Store keys and namespaces: exact keys for a tiny cache (a change of scheme shows here), the same
namespace on every mesh and pool size, a different one for every field that changes a page's bytes,
and precise errors for every bad argument."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from easykv.quantization import Int8Quantizer, _rotation
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh
from easykv.spec.groups import LayerGroup
from easykv.spec.metadata import PagedAttentionCacheMetaData
from easykv.tiers.store import codec
from easykv.tiers.store.namespace import StoreNamespace, _quantizer_params, model_slug

MODEL = "Qwen/Qwen3-8B@main"
DIGEST = bytes(range(32))
# The backends' key rule (easykv.tiers.store.backend): ASCII [A-Za-z0-9._/-], <= 512, no leading '/', no '..'.
KEY_RULE = re.compile(r"[A-Za-z0-9._/-]{1,512}")


def meta(**kw):
    """A tiny uniform cache: 2 layers, 2 kv heads, head dim 8, page 4, bfloat16."""
    args = dict(batch_size=2, num_hidden_layers=2, num_pages_per_layer=8, num_pages_per_sequence=4,
                max_sequences=16, page_size=4, num_kv_heads=2, kv_head_dim_size=8, hbm_utilization=0.5,
                dtype="bfloat16")
    args.update(kw)
    return PagedAttentionCacheMetaData(**args)


def grouped(sliding=None, full=None, **kw):
    """A tiny grouped cache: layers 0-1 sliding (window 8), layers 2-3 full; ``sliding`` /
    ``full`` replace fields of a group."""
    groups = (LayerGroup(layers=(0, 1), attention="sliding", window=8, num_pages=8, num_kv_heads=2, key_head_dim=8),
              LayerGroup(layers=(2, 3), num_pages=8, num_kv_heads=2, key_head_dim=8))
    groups = (dataclasses.replace(groups[0], **(sliding or {})), dataclasses.replace(groups[1], **(full or {})))
    args = dict(num_hidden_layers=4, num_kv_heads=max(g.num_kv_heads for g in groups),
                kv_head_dim_size=max(g.key_head_dim for g in groups), layer_groups=groups)
    args.update(kw)
    return meta(**args)


def valid_key(key):
    return KEY_RULE.fullmatch(key) is not None and not key.startswith("/") and ".." not in key


# --------------------------------------------------------------------------------- golden values
GROUPED_GOLDEN = ("8eef102a8da4853bbe582aff5c7692a2e1e5416cec282706dfa59098bd7cdf72",
                  "b7b7b75f768772bb7c2b61502c44658cce76031b93824c170f8d0248af9d753a")


def test_keys_of_a_tiny_cache_are_exactly_these():
    ns = StoreNamespace.of(meta(), MODEL)
    assert ns.model_slug == "Qwen-Qwen3-8B-main-f12e9da5f49cea5e"
    assert ns.group_namespaces == ("15467083bd942dc0d37d2089b34817d8672ec6aa75f6723f0d8f8e10ae9eae12",)
    assert ns.prefix() == "easykv-v1/Qwen-Qwen3-8B-main-f12e9da5f49cea5e/"
    assert ns.group_prefix(0) == "easykv-v1/Qwen-Qwen3-8B-main-f12e9da5f49cea5e/15467083bd942dc0d37d2089b34817d8/"
    assert ns.key(0, DIGEST, 1) == ("easykv-v1/Qwen-Qwen3-8B-main-f12e9da5f49cea5e/15467083bd942dc0d37d2089b34817d8/"
                                    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f/1")
    assert json.loads(ns.group_specs[0]) == {
        "attention": "full", "codec_format_version": 1, "key_head_dim": 8, "latent": False, "layers": [0, 1],
        "model_id": MODEL, "num_kv_heads": 2, "page_size": 4, "value_head_dim": 8, "window": None,
        "stored": {"dtype": "bfloat16", "quantizer": "none", "quantizer_format_version": None,
                   "quantizer_params": {}}}


def test_keys_of_a_grouped_quantized_cache_are_exactly_these():
    ns = StoreNamespace.of(grouped(quantization="int4-g4-asym-rot"), "m")
    assert ns.group_namespaces == GROUPED_GOLDEN
    assert ns.key(1, DIGEST, 0) == (f"easykv-v1/m-62c66a7a5dd70c31/{GROUPED_GOLDEN[1][:32]}/"
                                    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f/0")
    stored = json.loads(ns.group_specs[0])["stored"]
    assert stored["quantizer_params"] == {"asymmetric": True, "group_size": 4, "rotate": True}
    assert stored["layout"]["8"]["values"] == [[4], "uint8"] and stored["layout"]["8"]["scales"] == [2, 2]
    assert stored["layout"]["8"]["rotation"] == "0050d52f43bd1059b565a49bb9ee7d605f1d4a1eae3f717d894bdbeea2d309de"


def test_describe_is_json_and_says_what_the_digest_covers():
    ns = StoreNamespace.of(grouped(), MODEL)
    d = json.loads(json.dumps(ns.describe()))
    assert d["key_scheme"] == "easykv-v1" and d["model_id"] == MODEL and d["prefix"] == ns.prefix()
    assert [g["prefix"] for g in d["groups"]] == [ns.group_prefix(0), ns.group_prefix(1)]
    assert [g["spec"]["attention"] for g in d["groups"]] == ["sliding", "full"]
    assert [g["kv_heads"] for g in d["groups"]] == [2, 2]


# --------------------------------------------------------------------------------- what is shared
SAME = {
    "kv heads over tp=2": dict(kv_head_mesh_axes=("tp",), kv_head_shards=2),
    "pages over dp=2": dict(page_mesh_axes=("dp",), page_shards=2),
    "dp=2 x tp=2": dict(page_mesh_axes=("dp",), page_shards=2, kv_head_mesh_axes=("tp",), kv_head_shards=2),
    "more pages": dict(num_pages_per_layer=64),
    "larger batch": dict(batch_size=32),
    "longer sequences": dict(max_sequences=32, num_pages_per_sequence=8),
    "host tier": dict(host_pages_per_layer=16),
    "memory budget": dict(hbm_utilization=0.9, memory_bytes_per_device=2**20),
}


@pytest.mark.parametrize("change", list(SAME), ids=list(SAME))
def test_mesh_and_pool_sizes_share_the_namespace(change):
    base = StoreNamespace.of(meta(), MODEL)
    other = StoreNamespace.of(meta(**SAME[change]), MODEL)
    assert other == base and other.key(0, DIGEST, 1) == base.key(0, DIGEST, 1)


def test_tp8_dp2_tp4_and_one_device_caches_share_every_key(tp8, dp2tp4):
    pm = PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp"))
    one = create_mesh({"dp": 1, "tp": 1}, devices=jax.devices()[:1])
    metas = [PagedAttentionCacheMetaData.create(
        mesh, partition_manager=pm, batch_size=4, num_hidden_layers=4, max_sequences=100, page_size=16,
        num_kv_heads=8, kv_head_dim_size=128, hbm_utilization=0.9, dtype=jnp.bfloat16, memory_bytes_per_device=2**23)
        for mesh in (tp8, dp2tp4, one)]
    assert len({(m.kv_head_shards, m.page_shards, m.num_pages_per_layer) for m in metas}) == 3  # really different
    namespaces = [StoreNamespace.of(m, MODEL) for m in metas]
    assert namespaces[0] == namespaces[1] == namespaces[2]
    assert len({ns.key(0, DIGEST, 7) for ns in namespaces}) == 1


# --------------------------------------------------------------------------------- what is not
DIFFERENT = {
    "attention kind": lambda: grouped(sliding=dict(attention="full", window=None)),
    "window": lambda: grouped(sliding=dict(window=16)),
    "layers": lambda: grouped(sliding=dict(layers=(0, 2)), full=dict(layers=(1, 3))),
    "kv heads": lambda: grouped(sliding=dict(num_kv_heads=1)),
    "key head dim": lambda: grouped(sliding=dict(key_head_dim=4, value_head_dim=8)),
    "value head dim": lambda: grouped(sliding=dict(value_head_dim=4)),
    "latent": lambda: grouped(sliding=dict(latent=True)),
    "page size": lambda: grouped(page_size=8, max_sequences=32),
    "dtype": lambda: grouped(dtype="float32"),
    "group's own dtype": lambda: grouped(sliding=dict(dtype="float16")),
    "quantizer": lambda: grouped(quantization="int8"),
    "fp8 against int8": lambda: grouped(quantization="fp8"),
}


@pytest.mark.parametrize("field", list(DIFFERENT), ids=list(DIFFERENT))
def test_every_field_of_a_pages_bytes_changes_the_namespace(field):
    base = StoreNamespace.of(grouped(), MODEL)
    other = StoreNamespace.of(DIFFERENT[field](), MODEL)
    assert other.group_namespaces[0] != base.group_namespaces[0]
    assert other.key(0, DIGEST, 0) != base.key(0, DIGEST, 0)
    assert other.group_prefix(0) != base.group_prefix(0)  # and so never listed (or collected) as the other's


QUANTIZER_PAIRS = [("int8", "int8-rot"), ("int4", "int4-g4"), ("int4", "int4-asym"), ("int4-g4", "int4-g2"),
                   ("int4-ol", "int4-ol2"), ("int4-ch", "int4"), ("none", "int8")]


@pytest.mark.parametrize("a, b", QUANTIZER_PAIRS, ids=[f"{a} vs {b}" for a, b in QUANTIZER_PAIRS])
def test_every_quantizer_parameter_changes_the_namespace(a, b):
    assert StoreNamespace.of(meta(quantization=a), MODEL) != StoreNamespace.of(meta(quantization=b), MODEL)


def test_the_model_id_changes_the_namespace_and_the_slug():
    a, b = StoreNamespace.of(meta(), "org/model@v1"), StoreNamespace.of(meta(), "org/model@v2")
    assert a.group_namespaces != b.group_namespaces and a.model_slug != b.model_slug
    assert a.prefix() != b.prefix()


def test_the_codec_layout_version_changes_the_namespace(monkeypatch):
    base = StoreNamespace.of(meta(), MODEL)
    monkeypatch.setattr(codec, "FORMAT_VERSION", 2)
    assert StoreNamespace.of(meta(), MODEL).group_namespaces != base.group_namespaces


def test_the_rotation_seed_changes_the_namespace(monkeypatch):
    base = StoreNamespace.of(meta(quantization="int8-rot"), MODEL)
    monkeypatch.setattr(_rotation, "_SIGN_SEED", b"another seed")
    _rotation.rotation_matrix.cache_clear()
    try:
        assert StoreNamespace.of(meta(quantization="int8-rot"), MODEL) != base
    finally:
        monkeypatch.undo()
        _rotation.rotation_matrix.cache_clear()
    assert StoreNamespace.of(meta(quantization="int8-rot"), MODEL) == base


def test_a_quantizer_format_version_changes_the_namespace(monkeypatch):
    base = StoreNamespace.of(meta(quantization="int8"), MODEL)
    monkeypatch.setattr(Int8Quantizer, "format_version", 2, raising=False)
    assert StoreNamespace.of(meta(quantization="int8"), MODEL) != base


def test_weight_version_and_salt_stay_in_the_page_digest():
    # Not in the namespace: the manager's digest starts from the version's root and covers the salt.
    from easykv.manager.prefix_hash import page_digest, salt_digest, version_digest, version_root
    tokens = np.arange(4, dtype=np.int32)
    digests = {page_digest(version_root(version_digest(v)), salt_digest(s), tokens)
               for v in (None, "w1") for s in (None, "tenant")}
    ns = StoreNamespace.of(meta(), MODEL)
    assert len({ns.key(0, d, 0) for d in digests}) == 4


# --------------------------------------------------------------------------------- keys and slugs
@pytest.mark.parametrize("model_id", [MODEL, "../../etc/passwd", "a..b", "/abs", ".hidden", "模型", "x" * 200,
                                      "a b c", "..", "-", "gs://bucket/model"])
def test_keys_keep_the_backends_rule_for_any_model_id(model_id):
    ns = StoreNamespace.of(meta(num_kv_heads=2), model_id)
    for key in (ns.key(0, DIGEST, 1), ns.key(0, b"\xff" * 32, 0)):
        assert valid_key(key), key
        assert len(key) <= 200
    assert all(part not in ("", ".", "..") for part in ns.key(0, DIGEST, 1).split("/"))


def test_slugs_of_similar_ids_never_collide():
    ids = ["a/b", "a-b", "a_b", "A/B", "a//b", "a b", "a..b", "a.-b", "a" * 60, "a" * 61]
    assert len({model_slug(i) for i in ids}) == len(ids)
    assert model_slug("Qwen/Qwen3-0.6B@main").startswith("Qwen-Qwen3-0.6B-main-")


# --------------------------------------------------------------------------------- bad input
FIX = "pass model_id=, the name and revision of the weights, e.g. 'Qwen/Qwen3-8B@main'; easykv never guesses it"


@pytest.mark.parametrize("model_id, kind, shown", [
    (None, ValueError, "model_id=None"), ("", ValueError, "model_id=''"), (5, TypeError, "got int 5"),
    (b"Qwen", TypeError, "got bytes b'Qwen'"), ("x" * 201, ValueError, "got 201"),
    ("a\nb", ValueError, r"model_id='a\nb'"), ("a\tb", ValueError, r"model_id='a\tb'"),
    (" Qwen", ValueError, "model_id=' Qwen'"),
])
def test_a_missing_or_bad_model_id_is_refused_with_the_fix(model_id, kind, shown):
    with pytest.raises(kind) as err:
        StoreNamespace.of(meta(), model_id)
    assert shown in str(err.value) and FIX in str(err.value)


def test_a_metadata_without_its_dtype_or_no_metadata_is_refused():
    with pytest.raises(ValueError, match=r"leaves the page dtype open .* layers 0\.\.1 .*\(cache\.metadata"):
        StoreNamespace.of(meta(dtype=None), MODEL)
    with pytest.raises(TypeError, match="must be a PagedAttentionCacheMetaData, got dict"):
        StoreNamespace.of({}, MODEL)


@pytest.mark.parametrize("args, kind, message", [
    ((1, DIGEST, 0), ValueError, r"group must be .*, got 1 .*a layer group index of this cache \(0\.\.0\)"),
    ((-1, DIGEST, 0), ValueError, "group must be .*, got -1"),
    ((True, DIGEST, 0), ValueError, "group must be .*, got True"),
    ((0, DIGEST, 2), ValueError, r"head must be .*, got 2 .*a kv head of layer group 0 \(0\.\.1\)"),
    ((0, DIGEST, 1.0), ValueError, "head must be .*, got 1.0"),
    ((0, DIGEST[:31], 0), ValueError, "digest must be 32 bytes .* got 31"),
    ((0, DIGEST.hex(), 0), TypeError, "digest must be the page's 32-byte digest \\(bytes\\), got str"),
    ((0, bytearray(DIGEST), 0), TypeError, "got bytearray"),
])
def test_bad_key_arguments_are_refused_precisely(args, kind, message):
    ns = StoreNamespace.of(meta(), MODEL)
    with pytest.raises(kind, match=message):
        ns.key(*args)


def test_numpy_ints_name_the_same_key():
    ns = StoreNamespace.of(meta(), MODEL)
    assert ns.key(np.int64(0), DIGEST, np.int32(1)) == ns.key(0, DIGEST, 1)


def test_a_quantizer_field_the_namespace_cannot_hold_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Odd:
        table: tuple = (1, 2)
        name: str = "odd"

    with pytest.raises(ValueError, match=r"quantizer 'odd' has field table=\(1, 2\), .* give it such fields"):
        _quantizer_params(Odd())
