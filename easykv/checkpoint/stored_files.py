"""What the page files of a saved step must say, derived from its (verified) record alone, and
their comparison with it: each array's ``.zarray``, orbax's ``_METADATA`` of the pages, and the
names in each array's directory (used by `easykv.checkpoint.reader`).

A file is compared with what the record implies before anything it claims is acted on, so that
a check costs what was saved, not what a file says: a ``.zarray`` claiming one-element chunks
over a 4 GiB pool is refused by comparing a few fields, never by enumerating its grid.

What the record implies. orbax writes one zarr (v2) array per page array, uncompressed, C order,
each chunk one shard of the saving mesh: heads split over the kv-head mesh axes, pages over the
page mesh axes (`easykv.storage.pages.PageLayout`), everything else whole. A shard held by
several devices (replicated heads) may be written by its replicas together, each a slice along
one axis (orbax's replica-parallel write: the first axis the replica count divides); the chunk
is then that slice. So a chunk is the saving shard, or the shard divided evenly along one axis by
a divisor of its replica count, and the number of chunk files is at most the number of saving
devices. orbax's ``_METADATA`` lists exactly the record's arrays, each by its path, as a
``jax.Array`` it deserializes, written in chunks of that shape (``write_shape``), and the
``.zarray`` of each says the same chunks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from easykv.checkpoint.format import PAGES_ITEM
from easykv.checkpoint.orbax_types import EPath
from easykv.checkpoint.record import (
    canonical,
    group_index,
    is_stacked,
    read_small_file,
    saved_metadata,
    small_file,
)
from easykv.errors import CheckpointIntegrityError
from easykv.validation import parse_json

METADATA_FILE = "_METADATA"
ZARRAY_FILE = ".zarray"
# orbax's _METADATA beside the tree: how it reads the arrays back (per-array zarr v2 files).
_ORBAX_OPTIONS = {"use_ocdbt": False, "use_zarr3": False, "store_array_data_equal_to_fill_value": True,
                  "custom_metadata": None}
_DICT_KEY = 2  # orbax's key_type of a dict key (its KeyType.DICT)


@dataclasses.dataclass(frozen=True)
class SavedArray:
    """One page array of a step as its record says it was saved.

    Attributes:
      name: the record's name (``group_000.key_pages``).
      path: its PyTree path (``("group_000", "key_pages")``).
      shape: the global shape.
      dtype: the stored dtype.
      shard: the shape of one shard on the saving mesh.
      replicas: how many saving devices held each shard.
    """

    name: str
    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    shard: tuple[int, ...]
    replicas: int

    @property
    def zarr_dtype(self) -> str:
        """The dtype as tensorstore writes it in a ``.zarray``: numpy's string (``<u2``, ``|i1``),
        or the name of an ml_dtypes type (``bfloat16``; numpy's string, ``<V2``, would not say)."""
        return str(self.dtype.str if self.dtype.isbuiltin == 1 else self.dtype.name)  # 2: a registered type

    def chunks_problem(self, chunks: object) -> str | None:
        """Why ``chunks`` (from a file) is not a chunk shape this array was saved in (None: it is)."""
        if (not isinstance(chunks, list) or len(chunks) != len(self.shape)
                or not all(type(c) is int and c >= 1 for c in chunks)):
            return f"chunks {_cut(chunks)} are not {len(self.shape)} positive integers"
        odd = [a for a, (c, s) in enumerate(zip(chunks, self.shard)) if c != s]
        if not odd:
            return None
        if len(odd) == 1:
            parts = self.shard[odd[0]] // chunks[odd[0]]
            if parts > 1 and parts * chunks[odd[0]] == self.shard[odd[0]] and self.replicas % parts == 0:
                return None  # the replicas of a shard wrote a slice each
        return (f"chunks {chunks} are neither the shard of the saving mesh, {list(self.shard)}, nor that shard "
                f"split along one axis among the {self.replicas} device(s) that held it")

    def grid(self, chunks: Sequence[int]) -> tuple[int, ...]:
        """The chunk grid (chunks per axis) of chunks that `chunks_problem` accepted: at most
        one per saving device in all."""
        return tuple(-(-n // c) for n, c in zip(self.shape, chunks))


def saved_arrays(record: Mapping[str, Any], step: int, directory: EPath) -> list[SavedArray]:
    """Every array of a (schema-checked) record, in its order, with the shard it was saved in:
    its heads split over its layer group's kv-head mesh axes and its pages over the page mesh
    axes of the recorded mesh (`easykv.storage.placement.group_layouts`); the whole array when
    the record has no layout (a cache on one device)."""
    meta = saved_metadata(record, step, directory)
    mesh = record["mesh"]
    stacked = is_stacked(record["format_version"])
    heads_axis = 1 if stacked else 0  # (layers,) heads, pages, ...
    out = []
    for entry in record["arrays"]:
        shape = tuple(entry["shape"])
        shard = list(shape)
        if "shape" in mesh:
            group = meta.groups[group_index(entry["path"][0])] if stacked else None
            head_axes = meta.kv_head_mesh_axes if group is None or group.kv_head_mesh_axes is None \
                else group.kv_head_mesh_axes
            for axis, names in ((heads_axis, head_axes or ()), (heads_axis + 1, meta.page_mesh_axes)):
                shard[axis] = -(-shape[axis] // _mesh_size(mesh["shape"], names, entry["name"], step, directory))
        shards = math.prod(-(-n // s) for n, s in zip(shape, shard))
        if mesh["num_devices"] % shards:
            raise _damaged(f"record field mesh: its {mesh['num_devices']} devices cannot hold the {shards} shards "
                           f"{list(shard)} of array {entry['name']}", step, directory, entry["name"])
        out.append(SavedArray(entry["name"], tuple(entry["path"]), shape, np.dtype(entry["stored_dtype"]),
                              tuple(shard), mesh["num_devices"] // shards))
    return out


def _mesh_size(sizes: Mapping[str, int], names: Sequence[str], array: str, step: int, directory: EPath) -> int:
    missing = [n for n in names if n not in sizes]
    if missing:
        raise _damaged(f"array {array} is split over mesh axes {missing} that the record's mesh {dict(sizes)} lacks",
                       step, directory, array)
    return math.prod(sizes[n] for n in names)


# What orbax writes is about 160 bytes per .zarray and 300 per array in _METADATA; a limit of a
# few times that keeps a crafted 16 MiB JSON file (5 s and 800 MiB to parse) from being parsed.
ZARRAY_MAX_BYTES = 4096


def metadata_max_bytes(num_arrays: int) -> int:
    """The most bytes orbax's ``_METADATA`` of ``num_arrays`` arrays may hold."""
    return 4096 + 2048 * num_arrays


# ---- orbax's _METADATA --------------------------------------------------------------------------
def check_tree_metadata(directory: EPath, step: int, arrays: Sequence[SavedArray]) -> dict[str, tuple[int, ...]]:
    """Compare orbax's ``_METADATA`` of the pages, as a whole, with the record's ``arrays``; return
    each array's chunk shape (its ``write_shape``, by name). orbax restores the step by this file
    (easykv reads the arrays by the record), so a key orbax could no longer find is damage even
    when easykv could still read the step.

    Raises:
      CheckpointIntegrityError: the file is missing, not a small regular file, not JSON, or says
        anything but what the record implies; names the array where the difference is one's."""
    path = directory / str(step) / PAGES_ITEM / METADATA_FILE
    # A FIFO or a file larger than the record's arrays can need is refused before JSON parses it.
    data = read_small_file(path, metadata_max_bytes(len(arrays)), step, directory)
    where = f"orbax's metadata of the pages of step {step} in {directory} ({PAGES_ITEM}/{METADATA_FILE})"
    try:
        if data is None:
            raise ValueError("the file is missing")
        meta = parse_json(data.decode("utf-8"), what=METADATA_FILE)
    except (ValueError, UnicodeDecodeError) as err:
        raise _damaged(f"{where} is unreadable ({type(err).__name__}: {str(err)[:200]})", step, directory) from None
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    problem = difference(meta, {**_ORBAX_OPTIONS, "tree_metadata": tree}, "")
    if problem is not None or not isinstance(tree, dict):
        problem = problem or f"tree_metadata is {_cut(tree)}, not a JSON object"
        raise _damaged(f"{where} is not what orbax writes for a step of easykv: {problem}", step, directory)
    keys = {str(a.path): a for a in arrays}  # orbax's key of a path: the tuple's repr
    unknown, missing = sorted(set(tree) - set(keys)), sorted(set(keys) - set(tree))
    if unknown or missing:
        raise _damaged(f"{where} does not list the record's arrays: it lacks {[keys[k].name for k in missing[:3]]} "
                       f"and lists {[k[:80] for k in unknown[:3]]}, which the record does not", step, directory,
                       keys[missing[0]].name if missing else None)
    chunks = {}
    for key, array in keys.items():
        node = tree[key]
        value = node.get("value_metadata") if isinstance(node, dict) else None
        shape = value.get("write_shape") if isinstance(value, dict) else None
        want = {"key_metadata": [{"key": p, "key_type": _DICT_KEY} for p in array.path],
                "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": shape}}
        problem = difference(node, want, f"tree_metadata[{key}]") or array.chunks_problem(shape)
        if problem is not None or not isinstance(shape, list):  # chunks_problem: a list of positive ints
            raise _damaged(f"{where} does not describe array {array.name} as saved: {problem}", step, directory,
                           array.name)
        chunks[array.name] = tuple(shape)
    return chunks


# ---- each array's .zarray and directory -----------------------------------------------------------
def zarray_problem(array_dir: EPath, array: SavedArray, chunks: Sequence[int]) -> str | None:
    """Why the array's ``.zarray`` is not, field by field, the one orbax wrote for it (None: it
    is): its shape and dtype as written, the ``chunks`` of orbax's ``_METADATA``, no compressor
    or filter, C order, no fill value, zarr format 2 and ``.`` between chunk indices. The dtype is
    compared as written: ``>f4`` would be read as byte-swapped ``<f4`` values."""
    data, problem = small_file(array_dir / ZARRAY_FILE, ZARRAY_MAX_BYTES)
    if data is None:
        return problem or f"its {ZARRAY_FILE} is missing"
    try:
        meta = parse_json(data.decode("utf-8"), what=ZARRAY_FILE)
    except (ValueError, UnicodeDecodeError) as err:
        return f"its {ZARRAY_FILE} is not JSON ({str(err)[:100]})"
    want = {"chunks": list(chunks), "compressor": None, "dimension_separator": ".", "dtype": array.zarr_dtype,
            "fill_value": None, "filters": None, "order": "C", "shape": list(array.shape), "zarr_format": 2}
    problem = difference(meta, want, "")
    return None if problem is None else f"its {ZARRAY_FILE} is not the one written for it: {problem}"


def chunk_files_problem(array_dir: str, grid: Sequence[int]) -> str | None:
    """Why the names in a local array's directory are not exactly ``.zarray`` and the chunk
    grid's (None: they are). A missing chunk would read as zeros (easykv writes every chunk,
    zeros included) and a misnamed one would be left unread. Reads at most one name more than
    the grid holds (beside ``.zarray``), and keeps no set larger than the grid, which the record
    bounds (`SavedArray.grid`)."""
    expected = math.prod(grid)
    found: set[str] = set()
    with os.scandir(array_dir) as entries:
        for item in entries:
            if item.name == ZARRAY_FILE:
                continue
            if not _in_grid(item.name, grid):
                return (f"its chunk files are not the {expected} that its shape and chunks imply (named by grid "
                        f"position): [{_cut(item.name, 80)}] are not among them")
            found.add(item.name)  # distinct names in the grid: never more than it holds
    if len(found) == expected:
        return None
    missing = []
    for index in np.ndindex(*grid):  # stops at the third missing one: at most the grid, once
        name = ".".join(map(str, index))
        if name not in found:
            missing.append(name)
            if len(missing) == 3:
                break
    return (f"its chunk files are not the {expected} that its shape and chunks imply (named by grid position): "
            f"{missing} are missing")


def _in_grid(name: str, grid: Sequence[int]) -> bool:
    """Whether ``name`` is a chunk index of ``grid`` as zarr writes it: decimal, no leading zero."""
    parts = name.split(".")
    return len(parts) == len(grid) and all(
        p.isascii() and p.isdigit() and (p == "0" or p[0] != "0") and len(p) <= 18 and int(p) < g
        for p, g in zip(parts, grid))


# ---- comparison -----------------------------------------------------------------------------------
def difference(got: object, want: object, where: str) -> str | None:
    """The first place where parsed JSON ``got`` is not ``want``, in words (None: equal). Types
    count (``0`` is not ``false``); a dict's keys are compared as a set first; a list of numbers
    (a shape) is shown whole."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return f"{where or 'the file'} is {_cut(got)}, not a JSON object"
        unknown, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        if unknown or missing:
            return (f"{where or 'the file'} has keys {[_cut(k, 60) for k in unknown[:3]]} that are not written and "
                    f"lacks {missing[:3]}")
        for key in want:
            problem = difference(got[key], want[key], f"{where}.{key}" if where else key)
            if problem is not None:
                return problem
        return None
    if (isinstance(want, list) and isinstance(got, list) and len(got) == len(want)
            and any(isinstance(w, (dict, list)) for w in want)):  # a list of numbers is shown whole
        for i, (g, w) in enumerate(zip(got, want)):
            problem = difference(g, w, f"{where}[{i}]")
            if problem is not None:
                return problem
        return None
    if canonical(got) != canonical(want):
        return f"{where} is {_cut(got)}, expected {_cut(want)}"
    return None


def _cut(value: Any, n: int = 100) -> str:
    """A value from a file, shown as its JSON (a string with its quotes), cut to ``n`` characters."""
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= n else text[:n] + "..."


def _damaged(message: str, step: int, directory: EPath, array: str | None = None) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(f"{message}; the step's files are damaged — restore another step", array=array,
                                    step=step, directory=str(directory))


__all__ = ["METADATA_FILE", "ZARRAY_FILE", "ZARRAY_MAX_BYTES", "SavedArray", "check_tree_metadata",
           "chunk_files_problem", "difference", "metadata_max_bytes", "saved_arrays", "zarray_problem"]
