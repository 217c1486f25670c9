"""The shared prefix store across processes (issue 44): replicas in separate processes (each its own JAX
program on 8 CPU devices) sharing a file store and a real redis-server, the redis-server SIGKILLed while a
replica runs, and one multi-controller program (2 processes x 4 devices) writing head by head what another
reads. The processes run tests/multihost/store_worker.py."""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from easykv.multihost import launch_local
from tests.support.redis_server import redis_server

pytestmark = [pytest.mark.slow, pytest.mark.multihost]

WORKER = str(pathlib.Path(__file__).with_name("store_worker.py"))
# 8 requests of 80 tokens sharing the first 72: 4 whole shared pages of 16, then a page of each request's own
REQUESTS, PROMPT, SHARED_PAGES = 8, 80, 4


def replica(tmp_path, name, mesh, stores, *extra, wait=True):
    """Start a replica process (store_worker.py replica): a run per store ('none': without); its JSON runs."""
    out = tmp_path / f"{name}.json"
    argv = [sys.executable, WORKER, "replica", "--mesh", mesh, "--out", str(out), "--requests", str(REQUESTS),
            "--prompt-len", str(PROMPT), "--shared", "72", *extra]
    for url in stores:
        argv += ["--store", url]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # its own 8 devices, not the test's
    log = open(tmp_path / f"{name}.log", "w")
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=pathlib.Path(WORKER).parents[2])
    if not wait:
        return process, out
    return finish(process, out, tmp_path / f"{name}.log")


def finish(process, out, log, timeout=300):
    try:
        code = process.wait(timeout=timeout)
    finally:
        process.kill()
    assert code == 0, pathlib.Path(log).read_text()[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(params=["file", "redis"])
def store_url(request, tmp_path):
    if request.param == "file":
        yield f"file://{tmp_path / 'store'}"
        return
    with redis_server() as server:
        yield server.url


def test_a_second_replica_process_reads_what_the_first_wrote(store_url, tmp_path):
    [a] = replica(tmp_path, "a", "tp8", [store_url])
    assert a["metrics"]["values_written"] == (SHARED_PAGES + REQUESTS) * 8  # every full page, each kv head once
    # another process, another mesh, other users (seed 1: other suffixes), with the store and without
    b, alone = replica(tmp_path, "b", "dp2tp4", [store_url, "none"], "--seed", "1")
    m = b["metrics"]
    assert m["pages_read"] == SHARED_PAGES and m["values_read"] == SHARED_PAGES * 8, m
    assert m["refused"] == m["failures"] == m["dropped"] == 0, m
    assert b["prefilled"] == REQUESTS * (PROMPT - SHARED_PAGES * 16)  # only the pages of their own
    assert alone["prefilled"] == REQUESTS * PROMPT  # all admitted at once: no request found another's pages
    assert b["outputs"] == alone["outputs"]  # pages from the store: the tokens computed alone
    assert a["outputs"] != b["outputs"]  # (other prompts: the check above is not vacuous)


def test_redis_killed_while_the_second_replica_runs(tmp_path):
    with redis_server() as server:
        replica(tmp_path, "a", "tp8", [server.url])
        handshake = tmp_path / "handshake"
        handshake.mkdir()
        # a request arrives every step; after step 2 the store is gone for good
        process, out = replica(tmp_path, "b", "dp2tp4", [server.url, "none"], "--seed", "1", "--arrive-every", "1",
                               "--pause-at", "2", "--handshake", str(handshake), wait=False)
        deadline = time.monotonic() + 240
        while not (handshake / "paused").exists():
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "b.log").read_text()[-4000:]
            time.sleep(0.05)
        server.kill()
        (handshake / "resume").touch()
        b, alone = finish(process, out, tmp_path / "b.log")
    m = b["metrics"]
    assert b["outputs"] == alone["outputs"] and b["steps"] == alone["steps"]  # every step ran, no wrong token
    assert m["pages_read"] == SHARED_PAGES, m  # read before the kill
    assert m["failures"] >= 1 and not m["available"] and m["dropped"] >= 1, m  # counted: misses, writes dropped
    assert m["refused"] == 0, m


def reports(outputs):
    found = []
    for pid, out in enumerate(outputs):
        assert f"WORKER OK {pid}" in out, out
        [line] = [line for line in out.splitlines() if line.startswith("STORE REPORT ")]
        found.append(json.loads(line.removeprefix("STORE REPORT ")))
    return found


def test_one_program_writes_head_by_head_and_another_reads(tmp_path):
    url = f"file://{tmp_path / 'store'}"

    def program(mode, logs):
        return reports(launch_local([sys.executable, WORKER, mode, url], num_processes=2, cpu_devices_per_process=4,
                                    timeout=240, log_dir=str(tmp_path / logs)))

    # tp=8 over 2 processes: each holds 4 kv heads and writes exactly those (3 shared + 3 own pages of 4 tokens)
    w0, w1 = program("program-write", "write")
    assert (w0["held"], w1["held"]) == ([0, 1, 2, 3], [4, 5, 6, 7])
    for w in (w0, w1):
        assert w["put_heads"] == w["held"] and w["written"] == 6 * 4 and w["present"] == 0, w
        assert w["found"] == [0, 12, 12] and w["failures"] == w["refused"] == w["dropped"] == 0, w
    assert w0["keys"] == 6 * 8  # every head of every page once, by the process holding it
    # dp=2 x tp=4 over 2 processes: each holds one replica's pages of every head. The first prompt is read
    # best-effort with process 1 not waiting: the processes agree on what arrived on both (checked in lock-step
    # in the worker); the others wait and find their own page in the store, the shared ones on the device.
    # The replica a chain lands in is decided when its fetch begins: only the process holding it reads (every
    # head of it); the other reads nothing and never holds the first back.
    r0, r1 = program("program-read", "read")
    assert r0["held"] == r1["held"] == list(range(8))
    assert sorted([r0["read_heads"], r1["read_heads"]]) == [[], list(range(8))], (r0, r1)
    for r in (r0, r1):
        assert r["found"][0] == r0["found"][0] and r["found"][0] % 4 == 0, r
        assert r["found"][1:] == [16, 16], r
        assert r["refused"] == r["failures"] == 0, r
