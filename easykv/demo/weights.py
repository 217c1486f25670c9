"""The demo models' trained weights: one ``.npz`` per model in ``easykv/demo/weights/``.

tools/train_demo_model.py trains a `DemoModel` on the project's own documentation and writes
the file with `save_weights`; `load_model` reads it back for `easykv demo`. The file is data
read by this module only: `np.load` without pickles, every key, shape and dtype checked against
the model's config before a value is used, and the config the weights were trained with stored
inside (a JSON string) and compared, so a stale, truncated or crafted file is refused with a
ValueError naming what is wrong, never half-loaded into a model that then prints garbage. The
file is read whole through one checked descriptor (`easykv.checked_files`) before numpy sees
it: a FIFO, a device, a directory or a file far larger than the model's parameters is refused
by name (`FileRefusedError`) instead of blocking or filling memory; so is a zip whose end records
declare over twice the entries the model has, before ``zipfile`` parses its directory
(`easykv.checked_files.check_zip_directory`). A message lists at most a few names from the file.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import zipfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from easykv.checked_files import check_zip_directory, read_regular, show_names
from easykv.demo.model import DemoConfig, DemoModel
from easykv.errors import FileRefusedError
from easykv.validation import show

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
# float16: half the bytes of float32 for a file shipped in the package, and enough precision
# for weights of this size (bfloat16 would round them 8x coarser; numpy stores it as raw void).
STORED_DTYPE = np.dtype(np.float16)
_ACCEPTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))
_INFO_KEYS = ("config", "training")  # JSON strings beside the parameters
_MAX_JSON_CHARS = 2**16  # each entry of _INFO_KEYS: a few hundred characters in a file save_weights wrote
# Fields that do not change what the weights compute: the seed only draws random weights, and
# scan runs the same layers under a lax.scan (test_scanned_and_unrolled_steps_... checks it).
_IGNORED_FIELDS = ("seed", "scan")
_RERUN = "rerun tools/train_demo_model.py to write a file for this config"


def shipped_weights(name: str) -> Path:
    """The trained weights shipped for demo model ``name`` (`easykv.demo.run.MODELS`)."""
    return WEIGHTS_DIR / f"{name}.npz"


def param_arrays(model: DemoModel) -> dict[str, np.ndarray]:
    """The model's parameters by dotted path (``blocks.0.q.kernel``), as numpy arrays."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(str(p) for p in path): np.asarray(var.get_value()) for path, var in flat}


def param_shapes(cfg: DemoConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each parameter of a model of ``cfg`` (nothing computed)."""
    flat = nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: DemoModel(cfg)), nnx.Param))
    return {".".join(str(p) for p in path): tuple(var.get_value().shape) for path, var in flat}


def _config_fields(cfg: DemoConfig) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _IGNORED_FIELDS}


def save_weights(path: str | Path, model: DemoModel, training: dict[str, Any]) -> None:
    """Write ``model``'s parameters (as float16) with its config and ``training`` (what it was
    trained on and how: JSON-able) to ``path``, an ``.npz`` that `load_model` accepts."""
    arrays: dict[str, np.ndarray] = {k: v.astype(STORED_DTYPE) for k, v in param_arrays(model).items()}
    if any(not np.all(np.isfinite(v)) for v in arrays.values()):
        raise ValueError("a parameter does not fit in float16 (inf or nan after the cast); not saving")
    arrays["config"] = np.array(json.dumps(_config_fields(model.cfg), sort_keys=True))
    arrays["training"] = np.array(json.dumps(training, sort_keys=True))
    with open(path, "wb") as f:  # a path, not np.savez's habit of appending .npz to any name
        np.savez(f, **arrays)  # type: ignore[arg-type]


def _header(npz: Any, path: Path, key: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """(shape, dtype) of entry ``key`` from its .npy header, its data not read: a crafted
    entry of the wrong size is refused before it takes any memory."""
    with npz.zip.open(f"{key}.npy") as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):  # what np.savez writes
            raise ValueError(f"{path}: entry {key!r} has .npy format version {version}; {_RERUN}")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f)
    return tuple(shape), np.dtype(dtype)


def _entry(npz: Any, path: Path, key: str, shape: tuple[int, ...], dtypes: tuple[np.dtype[Any], ...],
           need: str) -> np.ndarray:  # fmt: skip
    """Entry ``key`` once its header shows ``shape`` and one of ``dtypes`` (``need`` says which)."""
    try:
        got_shape, got_dtype = _header(npz, path, key)
        if got_shape != shape or got_dtype not in dtypes:
            raise ValueError(f"{path}: entry {key!r} is {got_dtype} of shape {got_shape}, the model needs {need}; "
                             f"{_RERUN}")
        value: np.ndarray = npz[key]
    except (OSError, EOFError, zipfile.BadZipFile) as err:  # a member cut short or corrupt
        raise ValueError(f"{path}: cannot read entry {key!r} ({err}); {_RERUN}") from err
    if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
        raise ValueError(f"{path}: entry {key!r} holds inf or nan; {_RERUN}")
    return value


def _json_entry(npz: Any, path: Path, key: str) -> Any:
    """Entry ``key``: one JSON string (at most ``_MAX_JSON_CHARS``, so a crafted one cannot be huge)."""
    try:
        shape, dtype = _header(npz, path, key)
    except (OSError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"{path}: cannot read entry {key!r} ({err}); {_RERUN}") from err
    if dtype.kind != "U" or shape != () or dtype.itemsize > 4 * _MAX_JSON_CHARS:
        raise ValueError(f"{path}: entry {key!r} must be a JSON string, got {dtype} of shape {shape}; {_RERUN}")
    try:
        return json.loads(str(npz[key]))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: entry {key!r} is not JSON ({err}); {_RERUN}") from err


def max_file_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """The most bytes a weights file for parameters of ``shapes`` (`param_shapes`) may hold:
    twice what its entries can take as accepted (every parameter as float32, each JSON entry at
    its limit, a zip and .npy header per entry). A file `save_weights` wrote (float16) holds
    about a quarter of it; anything larger is not demo weights, however it was made."""
    entries = 4 * sum(math.prod(shape) for shape in shapes.values()) + len(_INFO_KEYS) * 4 * _MAX_JSON_CHARS
    return 2 * (entries + 1024 * (len(shapes) + len(_INFO_KEYS)))


def _file_bytes(path: Path, shapes: dict[str, tuple[int, ...]]) -> bytes:
    """The whole file at ``path``, read through one descriptor checked to be a regular file of
    at most `max_file_bytes` that does not change size while read (`easykv.checked_files`), and
    whose zip end records declare no more members than a file for parameters of ``shapes`` holds."""
    names = [*shapes, *_INFO_KEYS]
    try:
        blob = read_regular(path, max_bytes=max_file_bytes(shapes))
        # Twice the entries a file for this model holds: one with a few too many gets the precise
        # message below, naming them, and parsing that many costs nothing.
        is_zip = check_zip_directory(lambda offset, length: blob[offset:offset + length], len(blob),
                                     most_members=2 * len(names),
                                     longest_name=max(len(f"{n}.npy".encode()) for n in names),
                                     what=str(path), expected="a demo weights file for this model", path=path)
    except FileRefusedError as err:
        raise FileRefusedError(f"cannot read demo weights: {err}; demo weights are an .npz file that "
                               "tools/train_demo_model.py writes", path=path) from None
    except OSError as err:  # missing, unreadable
        raise ValueError(f"{path}: cannot read demo weights ({err}); {_RERUN}") from err
    if not is_zip:
        raise ValueError(f"{path}: not an .npz of demo weights (no zip end of central directory record); {_RERUN}")
    return blob


def read_weights(path: str | Path, cfg: DemoConfig) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The parameters in ``path`` (float32, by dotted path) for a model of ``cfg``, and the
    file's training record. ValueError, naming the entry, for anything but a file
    `save_weights` wrote for this config: not an npz, a missing or extra key, another config,
    a wrong shape or dtype (read from each entry's header, before its data), a non-finite value;
    `FileRefusedError` (a ValueError) for a path that is not a regular file of a plausible size."""
    path = Path(path)
    expected = param_shapes(cfg)
    blob = _file_bytes(path, expected)
    try:  # a zip, read as one: np.load would read a .npy (of any declared size) or a pickle too
        npz = np.lib.npyio.NpzFile(io.BytesIO(blob), allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"{path}: cannot read demo weights ({err}); {_RERUN}") from err
    with npz:
        missing = sorted((set(expected) | set(_INFO_KEYS)) - set(npz.files))
        extra = sorted(set(npz.files) - set(expected) - set(_INFO_KEYS))
        if missing or extra:
            raise ValueError(f"{path}: " + "; ".join(
                ([f"missing key(s) {show_names(missing)}"] if missing else [])
                + ([f"unexpected key(s) {show_names(extra)}"] if extra else [])
            ) + f"; {_RERUN}")  # fmt: skip
        stored, training = (_json_entry(npz, path, k) for k in _INFO_KEYS)
        want = _config_fields(cfg)
        if not isinstance(stored, dict) or not isinstance(training, dict):
            raise ValueError(f"{path}: entries 'config' and 'training' must be JSON objects; {_RERUN}")
        if stored != want:
            differ = sorted(str(k) for k in set(want) | set(stored) if stored.get(k) != want.get(k))
            shown = differ[:6]  # the names come from the file: a few of them (show_names counts them all)
            raise ValueError(f"{path}: entry 'config' was trained for another model (fields {show_names(differ)} "
                             f"differ: file {show({k: stored.get(k) for k in shown})}, model "
                             f"{show({k: want.get(k) for k in shown})}); {_RERUN}")  # fmt: skip
        params = {key: _entry(npz, path, key, shape, _ACCEPTED_DTYPES, f"float16 (or float32) of shape {shape}")
                  .astype(np.float32) for key, shape in sorted(expected.items())}  # fmt: skip
    return params, training


def load_model(cfg: DemoConfig, path: str | Path) -> DemoModel:
    """A `DemoModel` of ``cfg`` with the weights in ``path`` (checked by `read_weights`)."""
    params, _ = read_weights(path, cfg)
    model = DemoModel(cfg)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    loaded = [(p, var.replace(jnp.asarray(params[".".join(str(x) for x in p)]))) for p, var in flat]
    nnx.update(model, nnx.from_flat_state(loaded))
    return model
