"""Layer groups in the cache description: validation, the pages a window keeps, sizing per
group, JSON (the uniform JSON unchanged), presets and `easykv plan`."""

import json
import math

import numpy as np
import pytest

from easykv import LayerGroup, PagedAttentionCacheMetaData, group_pattern
from easykv.cli import main
from easykv.errors import SerializationError
from easykv.sharding import PartitionAxis, PartitionManager, ShardingAdjustedWarning
from easykv.spec.presets import PRESETS
from easykv.spec.sizing import tokens_per_gib

HEADS_TP = PartitionManager(PartitionAxis(kv_head_axis="tp"))
PAGES_DP = PartitionManager(PartitionAxis(kv_head_axis="tp", page_axis="dp"))
GiB = 2**30


def gemma3_groups(layers=12, window=64):
    return group_pattern(layers, "SSSSSF", S=dict(attention="sliding", window=window), F=dict(attention="full"))


def create(mesh, groups, *, memory=64 * 2**20, pm=HEADS_TP, layers=12, max_seq=512, page_size=16, heads=8, dim=64,
           **kw):
    return PagedAttentionCacheMetaData.create(mesh, 4, layers, max_seq, page_size, heads, dim, 0.9, "bfloat16",
                                              partition_manager=pm, memory_bytes_per_device=memory,
                                              layer_groups=groups, **kw)


# ---- the pages a window keeps ------------------------------------------------------------------
def _pages_touched(group, tokens, page_size):
    """Brute force: the most pages any position's readable keys (plus itself) span."""
    most = 0
    for p in range(tokens):
        first = group.first_needed_position(p)
        most = max(most, p // page_size - first // page_size + 1)
    return most


@pytest.mark.parametrize("kind,window", [("sliding", 1), ("sliding", 5), ("sliding", 16), ("sliding", 17),
                                         ("sliding", 33), ("sliding", 100), ("chunked", 16), ("chunked", 48),
                                         ("full", None)])
@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 90, 200])
def test_pages_per_sequence_is_the_most_a_window_spans(kind, window, tokens):
    group = LayerGroup(layers=(0,), attention=kind, window=window)
    assert group.pages_per_sequence(tokens, 16) == _pages_touched(group, tokens, 16)


def test_first_needed_position_follows_the_definitions():
    sliding, chunked = LayerGroup((0,), "sliding", 5), LayerGroup((0,), "chunked", 8)
    # a query at p sees keys p-4..p (5 keys); a chunked query sees its own chunk only
    assert [sliding.first_needed_position(p) for p in (0, 4, 5, 9)] == [0, 0, 1, 5]
    assert [chunked.first_needed_position(p) for p in (0, 7, 8, 15, 16)] == [0, 0, 8, 8, 16]
    assert LayerGroup((0,)).first_needed_position(10**6) == 0


# ---- bad groups: precise errors ----------------------------------------------------------------
@pytest.mark.parametrize("kwargs,words", [
    (dict(layers=(0,), attention="sliding"), "window must be a positive int"),
    (dict(layers=(0,), attention="sliding", window=0), "window must be a positive int"),
    (dict(layers=(0,), attention="chunked", window=-16), "chunk size"),
    (dict(layers=(0,), attention="sliding", window=2**70), "window must be a positive int"),
    (dict(layers=(0,), attention="full", window=8), "takes no window"),
    (dict(layers=(0,), attention="local"), "attention must be one of"),
    (dict(layers=()), "at least one layer"),
    (dict(layers=(1, 1)), "appear twice"),
    (dict(layers=(-1,)), "a layer index must be a non-negative int"),
    (dict(layers="01"), "sequence of layer indices"),
    (dict(layers=(0,), latent=True, key_head_dim=64, value_head_dim=128), "must be <= key_head_dim"),
    (dict(layers=(0,), latent="yes"), "latent"),
    (dict(layers=(0,), num_kv_heads=0), "num_kv_heads of layers"),
    (dict(layers=(0,), kv_head_shards=2), "give both or neither"),
])  # fmt: skip
def test_bad_group_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        LayerGroup(**kwargs)


@pytest.mark.parametrize("groups,words", [
    ((LayerGroup((0, 1, 2)), LayerGroup((2, 3))), "layer 2 is in layer_groups[0] and layer_groups[1]"),
    ((LayerGroup((0, 1)), LayerGroup((3,))), "layers [2] belong to no group"),
    ((LayerGroup((0, 1, 2, 3, 4)),), "names layer 4, but the model has num_hidden_layers=4"),
    ((LayerGroup((0, 1), "chunked", 24), LayerGroup((2, 3))), "chunk size 24, not a multiple of page_size=16"),
    ((LayerGroup((0, 1)), "full"), "must be a LayerGroup"),
])  # fmt: skip
def test_bad_group_sets_are_refused(tp8, groups, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        create(tp8, groups, layers=4)


def test_grouped_metadata_needs_consistent_easydel_fields(tp8):
    meta = create(tp8, gemma3_groups())
    with pytest.raises(ValueError, match="the EasyDeL fields give the largest group's figures"):
        meta.replace(num_pages_per_layer=meta.num_pages_per_layer - 1)
    unsized = tuple(g.__class__(**{**g.__dict__, "num_pages": None}) for g in meta.groups)
    with pytest.raises(ValueError, match=r"has no num_pages"):
        meta.replace(layer_groups=unsized)
    with pytest.raises(ValueError, match="give each LayerGroup its num_pages"):
        create(tp8, gemma3_groups(), num_pages_per_layer=64)
    with pytest.raises(ValueError, match=r"layer_groups \[1\] have no num_pages but the others do"):
        create(tp8, (LayerGroup(tuple(range(10)), num_pages=64), LayerGroup((10, 11))))


# ---- sizing per group --------------------------------------------------------------------------
def test_groups_are_sized_to_hold_the_same_sequences(tp8):
    meta = create(tp8, gemma3_groups())
    sliding, full = meta.groups
    assert (sliding.layers, full.layers) == ((0, 1, 2, 3, 4, 6, 7, 8, 9, 10), (5, 11))
    # one page of one layer on one device: 1 head (8 over tp=8) x 16 tokens x 64 dims x 2 B, K and V
    page = 2 * 1 * 16 * 64 * 2
    assert meta.group_page_bytes(sliding) == meta.group_page_bytes(full) == page
    need = {"sliding": math.ceil(63 / 16) + 1, "full": 512 // 16}  # window 64 spans at most 5 pages
    unit = page * (need["sliding"] * 10 + need["full"] * 2)  # one max-length sequence in every group
    budget = 64 * 2**20
    assert sliding.num_pages == budget * need["sliding"] // unit
    assert full.num_pages == budget * need["full"] // unit
    assert meta.bytes_per_device <= budget
    assert meta.bytes_per_device == page * (sliding.num_pages * 10 + full.num_pages * 2)
    assert meta.max_full_sequences == budget // unit
    assert meta.num_pages_per_layer == full.num_pages  # the EasyDeL field: the largest group


def test_one_full_group_is_the_uniform_cache(tp8):
    grouped = create(tp8, (LayerGroup(tuple(range(12))),))
    uniform = create(tp8, None)
    assert grouped == uniform and grouped.is_uniform and grouped.layer_groups is None
    # built by hand (or read from a version-2 JSON), the same single group is the same uniform cache
    by_hand = uniform.replace(layer_groups=uniform.groups)
    assert by_hand == uniform and by_hand.layer_groups is None and "layer_groups" not in by_hand.to_dict()
    other_layout = uniform.groups[0].__class__(**{**uniform.groups[0].__dict__, "kv_head_mesh_axes": None,
                                                  "kv_head_shards": None})
    assert not uniform.replace(memory_bytes_per_device=None, layer_groups=(other_layout,)).is_uniform  # another layout
    assert uniform.groups == (LayerGroup(tuple(range(12)), num_kv_heads=8, key_head_dim=64, value_head_dim=64,
                                         num_pages=uniform.num_pages_per_layer, kv_head_mesh_axes=("tp",),
                                         kv_head_shards=8),)


def test_groups_with_their_own_geometry(tp8):
    # an MLA-like latent group (1 head: replicated over tp) next to a K/V group with V of its own dim
    groups = (LayerGroup((0, 1), latent=True, num_kv_heads=1, key_head_dim=96, value_head_dim=64),
              LayerGroup((2, 3), num_kv_heads=8, key_head_dim=64, value_head_dim=32))
    with pytest.warns(ShardingAdjustedWarning, match="replicated"):
        meta = create(tp8, groups, layers=4)
    latent, kv = meta.groups
    assert (latent.kv_head_shards, kv.kv_head_shards) == (1, 8)
    assert meta.group_page_bytes(latent) == 1 * 16 * 96 * 2  # one latent, no value pages
    assert meta.group_page_bytes(kv) == 1 * 16 * (64 + 32) * 2
    assert (meta.num_kv_heads, meta.kv_head_dim_size) == (8, 96)
    assert meta.bytes_per_token == 2 * (1 * 96 * 2) + 2 * (8 * 96 * 2)


def test_dp_split_groups_are_multiples_of_the_replicas(dp2tp4):
    meta = create(dp2tp4, gemma3_groups(), pm=PAGES_DP)
    assert meta.page_shards == 2 and all(g.num_pages % 2 == 0 for g in meta.groups)
    assert meta.bytes_per_device <= 64 * 2**20


def test_too_small_a_budget_names_the_groups(tp8):
    with pytest.raises(ValueError,
                       match=r"holds less than one sequence .* 466944 bytes .*: 5 pages x 10 layers x 4096 bytes"):
        create(tp8, group_pattern(12, "SSSSSF", S=dict(attention="sliding", window=64), F={}), memory=10_000)


def test_gemma3_pattern_holds_over_4x_the_tokens_per_gib(tp8):
    preset = PRESETS["gemma-3-27b"]
    meta = PagedAttentionCacheMetaData.create(
        tp8, 8, preset.layers, 32768, 16, preset.num_kv_heads, preset.head_dim, 0.9, "bfloat16",
        partition_manager=HEADS_TP, memory_bytes_per_device=16 * GiB, layer_groups=preset.layer_groups())
    held, uniform = tokens_per_gib(meta, 32768), tokens_per_gib(meta, 32768, uniform=True)
    # 10 full layers keep 2048 pages, 52 sliding ones ceil(1023 / 16) + 1 = 65: (62 x 2048) / (10 x 2048 + 52 x 65)
    assert held / uniform == pytest.approx(62 * 2048 / (10 * 2048 + 52 * 65))
    assert held / uniform >= 4


def test_sizing_helpers_refuse_a_grouped_cache(tp8):
    from easykv.spec.sizing import estimated_memory_size

    with pytest.raises(ValueError, match="size a uniform cache"):
        estimated_memory_size(create(tp8, gemma3_groups()), GiB)


# ---- JSON --------------------------------------------------------------------------------------
def test_grouped_json_round_trips_exactly(dp2tp4):
    meta = create(dp2tp4, gemma3_groups(), pm=PAGES_DP)
    text = meta.to_json()
    data = json.loads(text)
    assert data["__version__"] == 2 and data["layer_groups"][1]["attention"] == "full"
    again = PagedAttentionCacheMetaData.from_json(text)
    assert again == meta and hash(again) == hash(meta) and isinstance(again.layer_groups, tuple)


def test_uniform_json_is_what_version_1_wrote(tp8):
    data = create(tp8, None).to_dict()
    assert data["__version__"] == 1 and "layer_groups" not in data


@pytest.mark.parametrize("edit,words", [
    (lambda d: d.update(__version__=1), "version 1 holds \\['layer_groups'\\], which version 2 added"),
    (lambda d: d.update(layer_groups={"layers": [0]}), "must be a list of LayerGroup dicts"),
    (lambda d: d["layer_groups"][0].update(window=0), "window must be a positive int"),
    (lambda d: d["layer_groups"][0].update(layers=[0, 1]), r"layers \[2, 3, 4, 6, 7, 8, ...\] belong to no group"),
    (lambda d: d["layer_groups"][0].update(layers=list(range(6))), "layer 5 is in layer_groups\\[0\\] and"),
    (lambda d: d["layer_groups"][0].pop("__schema__"), "missing '__schema__'"),
])  # fmt: skip
def test_crafted_grouped_json_is_refused(tp8, edit, words):
    data = create(tp8, gemma3_groups()).to_dict()
    edit(data)
    with pytest.raises((SerializationError, ValueError), match=words):
        PagedAttentionCacheMetaData.from_dict(data)


# ---- presets and plan --------------------------------------------------------------------------
def test_presets_have_their_published_patterns():
    p = PRESETS
    g3 = p["gemma-3-27b"].layer_groups()
    assert [g.attention for g in g3] == ["sliding", "full"] and g3[1].layers == tuple(range(5, 62, 6))
    assert g3[0].window == 1024
    assert p["gemma-2-9b"].layer_groups()[0].layers == tuple(range(0, 42, 2))
    assert p["gpt-oss-20b"].layer_groups()[0].window == 128 and p["gpt-oss-20b"].layers == 24
    scout = p["llama-4-scout"].layer_groups()
    assert scout[0].attention == "chunked" and scout[0].window == 8192 and scout[1].layers == tuple(range(3, 48, 4))
    assert [g.attention for g in p["mistral-7b-v0.1"].layer_groups()] == ["sliding"]
    (mla,) = p["deepseek-v3"].layer_groups()
    assert mla.latent and p["deepseek-v3"].head_dim == 576 and mla.value_head_dim == 512


def _plan(capsys, *argv):
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_each_group_and_tokens_per_gib(capsys):
    code, out, err = _plan(capsys, "--preset", "gemma-3-27b", "--mesh", "tp=8", "--memory", "16GiB",
                           "--max-seq", "32768")
    assert code == 0 and err == ""
    assert "group 0" in out and "sliding window 1024" in out and "layers [5, 11, 17" in out
    ratio = float(out.split("tokens per GiB at 32,768 context")[1].split("(")[1].split("x")[0])
    assert ratio == pytest.approx(62 * 2048 / (10 * 2048 + 52 * 65), abs=0.01)
    code, out, _ = _plan(capsys, "--preset", "gemma-3-27b", "--uniform", "--mesh", "tp=8", "--memory", "16GiB")
    assert code == 0 and "group 0" not in out and "(1.00x" in out


def test_plan_gives_the_layers_of_one_kind_a_quantizer_of_their_own(capsys):
    def held(text):
        line = text.split("tokens per GiB at 32,768 context")[1].split("\n")[0]
        return float(line.split()[0].replace(",", "")), float(line.split("(")[1].split("x")[0])

    base = ("--preset", "gemma-3-27b", "--mesh", "tp=8", "--memory", "16GiB", "--max-seq", "32768")
    code, out, err = _plan(capsys, *base, "--group-quant", "full=int8")
    assert code == 0 and err == ""
    sliding = next(line for line in out.splitlines() if "sliding window 1024" in line)
    full = next(line for line in out.splitlines() if "layers [5, 11, 17" in line)
    assert full.endswith("own format int8") and "own format" not in sliding
    # an int8 token-head costs (128 + 4) / 256 of a bf16 one; the comparison is with every layer
    # full attention in the same formats, so the ratio is the windows' gain alone
    r = (128 + 4) / 256
    tokens, ratio = held(out)
    assert ratio == pytest.approx((10 * 2048 * r + 52 * 2048) / (10 * 2048 * r + 52 * 65), abs=0.01)
    _, plain, _ = _plan(capsys, *base)
    assert tokens / held(plain)[0] == pytest.approx((10 * 2048 + 52 * 65) / (10 * 2048 * r + 52 * 65), rel=1e-3)
    code, out, _ = _plan(capsys, *base, "--group-quant", "sliding=fp8", "--group-quant", "full=int4")
    assert code == 0 and "own format fp8" in out and "own format int4" in out
    for argv, words in ((("--preset", "llama-3.1-8b", "--group-quant", "full=int8"), "kinds ['none"),
                        (("--preset", "gemma-2-9b", "--group-quant", "chunked=int8"), "names ['chunked']"),
                        (("--preset", "gemma-2-9b", "--group-quant", "full"), "write KIND=NAME"),
                        (("--preset", "gemma-2-9b", "--group-quant", "full=int8", "--group-quant", "full=fp8"),
                         "names full twice"),
                        (("--layers", "2", "--kv-heads", "8", "--head-dim", "64", "--group-quant", "full=int8"),
                         "needs a --preset"),
                        (("--preset", "gemma-2-9b", "--group-quant", "full=int9"), "unknown quantizer 'int9'")):
        code, _, err = _plan(capsys, *argv, "--mesh", "tp=8", "--memory", "1GiB")
        assert code == 2 and words in err, (argv, err)


def test_plan_refuses_changing_a_patterned_preset(capsys):
    code, out, err = _plan(capsys, "--preset", "gemma-2-9b", "--layers", "10", "--memory", "1GiB", "--mesh", "tp=8")
    assert code == 2 and "has a layer pattern" in err


def test_pattern_helper_errors():
    with pytest.raises(ValueError, match="letters \\['X'\\] have no group"):
        group_pattern(4, "FX", F={})
    with pytest.raises(ValueError, match="non-empty string"):
        group_pattern(4, "", F={})
    assert np.array_equal(group_pattern(5, "SF", S=dict(attention="sliding", window=3), F={})[1].layers, (1, 3))


# ---- what does not take groups yet refuses them, before any state exists -----------------------
def test_a_per_layer_checkpoint_cannot_claim_groups(tp8, tmp_path):
    """Formats 1-2 (one array per layer) were written before layer groups: a record of them that
    names grouped metadata is damage (grouped checkpoints: tests/checkpoint/test_group_checkpoint.py)."""
    from easykv.checkpoint.record import saved_metadata
    from easykv.errors import CheckpointIntegrityError

    meta = create(tp8, gemma3_groups())
    with pytest.raises(CheckpointIntegrityError, match=r"a checkpoint of format 2 holds uniform caches .* layers "
                                                       r"\[5, 11\]: full"):
        saved_metadata({"metadata": meta.to_dict(), "format_version": 2}, 3, tmp_path)
    assert saved_metadata({"metadata": meta.to_dict(), "format_version": 3}, 3, tmp_path) == meta


# ---- EasyDeL models with sliding and full layers ---------------------------------------------
def test_easydel_layer_types_become_groups_of_one_pool(tp8):
    """What use_easykv derives from an EasyDeL config's layer_types (pure functions, no EasyDeL
    needed): sliding and full groups in the cache-wide geometry and the one pool EasyDeL's single
    page table addresses; EasyDeL's config of it is the uniform one's; other groupings refused."""
    from types import SimpleNamespace

    from easykv.integrations._easydel_config import layer_groups_from_model, shares_one_table, with_model_groups
    from easykv.integrations.easydel import easydel_config_dict

    text = SimpleNamespace(layer_types=["sliding_attention", "full_attention"] * 6, sliding_window=128)
    groups = layer_groups_from_model(text)
    assert [(g.layers, g.attention, g.window) for g in groups] == [
        ((0, 2, 4, 6, 8, 10), "sliding", 128), ((1, 3, 5, 7, 9, 11), "full", None)]
    for other in (SimpleNamespace(layer_types=["full_attention"] * 12, sliding_window=128),
                  SimpleNamespace(layer_types=["sliding_attention", "chunked_attention"] * 6, sliding_window=128),
                  SimpleNamespace(layer_types=["sliding_attention"] * 12, sliding_window=None),
                  SimpleNamespace(sliding_window=4096)):
        assert layer_groups_from_model(other) is None
    uniform = create(tp8, None)
    grouped = with_model_groups(uniform, groups)
    assert shares_one_table(grouped) and [g.num_pages for g in grouped.groups] == [uniform.num_pages_per_layer] * 2
    assert grouped.bytes_per_device == uniform.bytes_per_device
    assert easydel_config_dict(grouped, version="v2") == easydel_config_dict(uniform, version="v2")
    sized = create(tp8, gemma3_groups())  # the sliding group in a smaller pool: no single table fits
    with pytest.raises(ValueError, match="one page table and one geometry"):
        easydel_config_dict(sized, version="v2")
