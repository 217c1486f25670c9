"""Child processes of tests/checkpoint/test_checkpoint_writers.py (run as a script, never collected).

    python checkpoint_writer_child.py hold DIR      take DIR's writer lock, print HOLDING, sleep
    python checkpoint_writer_child.py efbig DIR     saves under RLIMIT_FSIZE: file too large
    python checkpoint_writer_child.py enospc DIR    saves into a nearly full filesystem (DIR's parent)

The last two print one JSON line (``RESULT {...}``) that the test checks: what each failed
save raised, the steps listed afterwards, and whether the earlier step restores bit-exact.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for tests.support
from tests.support.devices import configure  # noqa: E402

configure()  # 8 simulated CPU devices

from easykv.checkpoint.checkpointer import CacheCheckpointer, list_steps, restore_cache, save_cache  # noqa: E402
from easykv.errors import CheckpointWriteError  # noqa: E402
from tests.support.checkpoints import engine_run, flip_fixture, qsetup, raw_leaves  # noqa: E402


def failure(run) -> dict:
    """What ``run()`` raised: a CheckpointWriteError's fields, or the wrong outcome."""
    try:
        run()
    except CheckpointWriteError as err:
        return {"type": "CheckpointWriteError", "errno": err.errno, "step": err.step, "directory": err.directory,
                "message": str(err), "cause": type(err.__cause__).__name__}
    except Exception as err:  # noqa: BLE001  reported to the test as a failure
        return {"type": type(err).__name__, "message": str(err)[:500]}
    return {"type": "nothing raised"}


def intact(directory: str, step: int, cache, manager, mesh, pm) -> bool:
    restored = restore_cache(directory, mesh=mesh, partition_manager=pm, step=step)
    return (all((a == b).all() for a, b in zip(raw_leaves(restored.cache), raw_leaves(cache)))
            and restored.manager.state_dict() == manager.state_dict())


def attack(directory: str, limit, unlimit) -> dict:
    """Step 0 saved; then, under ``limit()``, a sync save, an async save whose failure surfaces
    at wait_until_finished, and one whose failure surfaces at close; then ``unlimit()``."""
    cache, manager, _ = engine_run("single")
    mesh, pm, _ = qsetup("single")
    save_cache(directory, cache, manager, step=0)
    limit()
    out = {"sync": failure(lambda: save_cache(directory, cache, manager, step=1))}
    ckpt = CacheCheckpointer(directory)
    ckpt.save(cache, manager, step=2)  # returns once snapshotted; the write fails in the background
    out["wait"] = failure(ckpt.wait_until_finished)
    ckpt.save(cache, manager, step=3)
    out["close"] = failure(ckpt.close)
    unlimit()
    out["steps_after_failures"] = list_steps(directory)
    out["step0_intact"] = intact(directory, 0, cache, manager, mesh, pm)
    save_cache(directory, cache, manager, step=4)  # the next writer clears the leftovers and saves
    out["steps_after_retry"] = list_steps(directory)
    out["leftovers"] = sorted(p.name for p in Path(directory).iterdir() if "tmp" in p.name)
    out["step4_intact"] = intact(directory, 4, cache, manager, mesh, pm)
    return out


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    if mode == "hold":
        ckpt = CacheCheckpointer(directory)
        print("HOLDING", os.getpid(), flush=True)
        time.sleep(600)
        ckpt.close()
        return
    if mode == "efbig":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing us
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        # 4 KiB: the record and manager state fit, the 12 KiB page chunks do not (tensorstore's error)
        out = attack(directory, lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard)),
                     lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard)))
        # 1 KiB with the flip fixture: its 512-byte chunks fit, the JSON record does not (Python's OSError)
        cache, manager, _, _ = flip_fixture()
        other = directory + "-json"
        save_cache(other, cache, manager, step=0)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        out["sync_json"] = failure(lambda: save_cache(other, cache, manager, step=1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        out["json_steps"] = list_steps(other)
    else:  # enospc: DIR's parent is a small tmpfs of our own
        filler = Path(directory).parent / "filler"

        def fill() -> None:
            stat = os.statvfs(directory)
            free = stat.f_bavail * stat.f_frsize
            with open(filler, "wb") as f:  # leave 8 KiB: the step starts, then runs out
                f.write(b"\0" * max(0, free - 8192))

        out = attack(directory, fill, filler.unlink)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
