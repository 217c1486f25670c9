"""launch_local's argument checks: every bad argument is refused by name before any process
starts or any log is written."""

import sys

import pytest

from easykv.multihost import launch_local


@pytest.mark.parametrize("bad, message", [
    ({"num_processes": 0}, r"num_processes must be a positive int, got 0"),
    ({"num_processes": 2**100}, r"num_processes must be a positive int, got 1267650600228229401496703205376"),
    ({"num_processes": 2.0}, r"num_processes must be a positive int, got 2\.0"),
    ({"cpu_devices_per_process": True}, r"cpu_devices_per_process must be a positive int, got True"),
    ({"timeout": 0}, r"timeout must be a number in \(0, inf\), got 0"),
    ({"timeout": -1.5}, r"timeout must be a number in \(0, inf\), got -1\.5"),
    ({"timeout": float("nan")}, r"timeout must be a number .*got nan"),
    ({"timeout": "10"}, r"timeout must be a number .*got '10' of type str"),
    ({"timeout": True}, r"timeout must be a number .*got True"),
    ({"argv": []}, r"argv must be a non-empty list of strings"),
    ({"argv": "python worker.py"}, r"argv must be a non-empty list of strings"),
    ({"argv": [sys.executable, 3]}, r"argv\[1\] must be a string or a path, got 3 of type int"),
    ({"argv": ["/no/such/program"]}, r"argv\[0\] = '/no/such/program' is neither an executable"),
    ({"log_dir": None}, r"log_dir must be a directory path, got None"),
])  # fmt: skip
def test_launch_local_rejects_bad_arguments_before_starting_anything(bad, message, tmp_path):
    logs = tmp_path / "logs"
    kwargs = {"argv": [sys.executable, "-c", "pass"], "log_dir": str(logs), **bad}
    with pytest.raises(ValueError, match=message):
        launch_local(kwargs.pop("argv"), **kwargs)
    assert not logs.exists()  # nothing was started or written
