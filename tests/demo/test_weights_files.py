"""The demo's weights file is read through the one descriptor that was checked: a FIFO (which
hung ``np.load`` forever: issue 42), a device, a directory, a link to either, or a file far larger
than the model's parameters is refused by name at once, as `FileRefusedError` from
`read_weights` and as one line with exit code 2 from ``easykv demo --weights``."""

import numpy as np
import pytest

import easykv.demo.run as demo_run
from easykv.cli import main
from easykv.demo.weights import max_file_bytes, param_shapes, read_weights, shipped_weights
from easykv.errors import FileRefusedError
from tests.support.hostile_files import finishes_within, hostile_paths, sparse_file

HYBRID = demo_run.MODELS["hybrid"]


def _refusals(tmp_path):
    """``name -> (path, words)``: the hostile paths and a sparse file past the size limit."""
    huge = sparse_file(tmp_path / "huge.npz", 1 << 40, head=shipped_weights("hybrid").read_bytes())
    return {**hostile_paths(tmp_path), "huge-sparse": (huge, f"{1 << 40} bytes, more than the")}


NAMES = ["fifo", "dev-zero", "directory", "link-to-fifo", "link-to-dev-zero", "huge-sparse"]


@pytest.mark.parametrize("name", NAMES)
def test_read_weights_refuses_what_is_no_regular_file_of_a_plausible_size(tmp_path, name):
    path, words = _refusals(tmp_path)[name]
    err = finishes_within(lambda: read_weights(path, HYBRID), fifos=(tmp_path / "weights.fifo",))
    assert type(err) is FileRefusedError, err
    message = str(err)
    assert message.startswith(f"cannot read demo weights: {path} ") and words in message, message
    assert "an .npz file that tools/train_demo_model.py writes" in message, message
    assert err.path == str(path)


@pytest.mark.parametrize("name", NAMES)
def test_easykv_demo_refuses_such_weights_in_one_line_with_exit_code_2(tmp_path, name, capsys):
    path, words = _refusals(tmp_path)[name]
    code = finishes_within(lambda: main(["demo", "--weights", str(path), "--no-progress"]),
                           fifos=(tmp_path / "weights.fifo",))  # fmt: skip
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and captured.out == "", (code, captured)
    assert len(lines) == 1 and lines[0].startswith(f"easykv demo: error: cannot read demo weights: {path} "), lines
    assert words in lines[0], lines


def test_the_size_limit_is_a_few_times_the_parameters_and_admits_every_shipped_file():
    for name, cfg in demo_run.MODELS.items():
        limit = max_file_bytes(param_shapes(cfg))
        parameters = 4 * sum(int(np.prod(shape)) for shape in param_shapes(cfg).values())
        assert 2 * parameters <= limit <= 3 * parameters, (name, limit, parameters)
        assert shipped_weights(name).stat().st_size < limit / 3, name


def test_a_link_to_real_weights_is_followed(tmp_path):
    # A path the user names may be a link: what it leads to decides, not the link.
    link = tmp_path / "weights-link.npz"
    link.symlink_to(shipped_weights("hybrid"))
    params, _ = read_weights(link, HYBRID)
    direct, _ = read_weights(shipped_weights("hybrid"), HYBRID)
    assert params.keys() == direct.keys() and all(np.array_equal(params[k], direct[k]) for k in params)
