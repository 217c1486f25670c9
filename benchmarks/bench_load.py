"""A random load run with scrubbing on: does a long-running server stay bounded?

    python benchmarks/bench_load.py                  # five minutes of load (the figures in docs/benchmarks.md)
    python benchmarks/bench_load.py --seconds 60
    python benchmarks/bench_load.py --quick          # 20 s of load: checks the script runs (CI)

The trained demo model ("uniform": 4 layers, 8 kv heads over tp=8 on 8 simulated CPU devices,
float32) serves random traffic through a `PageManager` with ``scrub_released=True`` and a host
tier, on a pool of 256 pages of 8 tokens (host tier: 256 pages). Every iteration draws events,
then runs one engine step:

- arrivals: ``claim`` and ``match_prefix`` of the demo's prompts (a shared system prompt, one of
  twelve openings, a random tail), prefilled in chunks through ``build_step_metadata`` and the
  model's jitted step, which writes their K/V into the cache (decodes ride in the same step);
- decodes: when nothing waits for prefill, ``plan_decode`` of up to 4 steps run in one device
  loop (``paged_decode``) and ``commit_decode`` (zero tokens on a failure: every plan is closed
  before anything else touches its sequences);
- forks, truncations, releases (requests finish at their length, others are dropped at
  random), weight versions (``set_weight_version``, only between plans), swaps to and from the
  host tier (``swap_out`` / ``swap_in``; a step that does not fit preempts its newest request to
  the host), and checkpoints (``save_cache`` every ``--checkpoint-every`` seconds, swapped
  requests brought back first; every second one restored and compared page for page and state
  for state).

Targets (issue 42): the programs compiled inside ``apply_pending`` (the device work: copies,
scrubs and host transfers, whatever program does them, counted as jax lowers them) at most
``2 + log2(pool pages)``; memory flat after warm-up (the first quarter of the run, and at least
until a checkpoint was restored: orbax's first save and restore set up what it keeps): RSS
growth from the census that closes warm-up to the end under ``--rss-slack`` MiB, and the heap
malloc has handed out ("held") under ``--heap-slack`` MiB; every page free at the end (every
sequence released, the prefix cache emptied, `check_invariants`, every device and host page
reads zero since scrubbing is on). RSS alone does not say whether the process holds more: glibc
keeps freed blocks in its per-thread arenas, so a checkpoint's megabyte buffers, allocated and
freed by orbax's, tensorstore's and the reader's threads, raise RSS towards a ceiling while the
heap in use stays flat (``process_memory``'s doc; ``MALLOC_ARENA_MAX=2`` keeps RSS flat too). So
the table also gives RssAnon, malloc's held and free-but-kept MiB, the live jax arrays and the
Python objects after warm-up and at the end, and RSS slopes over the window and its last half.
Also reported: steps, tokens, every program lowered (and which after warm-up), the median host
time of a step (its wall time less the time spent in calls that run device programs: on CPU
those run on the host's cores) and the median checkpoint save. Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from process_memory import Census, Sample  # noqa: E402  (benchmarks/, the script's own folder)

import easykv  # noqa: E402
from easykv.demo.model import CompiledModel  # noqa: E402
from easykv.demo.run import demo_model  # noqa: E402
from easykv.demo.workload import OPENINGS, SYSTEM_PROMPT, encode  # noqa: E402
from easykv.errors import CacheFullError  # noqa: E402
from easykv.manager.step_plan import StepPlan  # noqa: E402
from easykv.sharding import PartitionAxis, PartitionManager, create_mesh  # noqa: E402

POOL, HOST_POOL, PAGE, SEQS, MAX_LEN, BUDGET, DECODE_STEPS = 256, 256, 8, 8, 256, 64, 4
LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CENSUSES = 16  # costly memory readings (a full gc each) per run, from its first quarter on
# Per iteration: the chance of each event (arrivals only while a sequence slot is free).
EVENTS = {"arrive": 0.5, "fork": 0.06, "truncate": 0.05, "drop": 0.02, "version": 0.01, "swap_out": 0.03,
          "swap_in": 0.15}


@jax.jit
def _greedy(logits: jax.Array, ends: jax.Array) -> jax.Array:
    """The greedy token after each row's last position (``ends``: one per sequence row)."""
    return jnp.argmax(jnp.take(logits, ends, axis=0), axis=-1)


class Lowered:
    """Every program jax lowers from now on: (``time.perf_counter()``, name); those lowered
    inside `counting_device_work` blocks also in ``device_work``."""

    def __init__(self) -> None:
        self.programs: list[tuple[float, str]] = []
        self.device_work: list[str] = []
        self._in_device_work = False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs: object) -> None:
        if event == LOWERED:
            self.programs.append((time.perf_counter(), str(kwargs.get("fun_name"))))
            if self._in_device_work:
                self.device_work.append(self.programs[-1][1])

    @contextlib.contextmanager
    def counting_device_work(self) -> Iterator[None]:
        """Every program lowered inside the block counts as device work, whatever it is."""
        self._in_device_work = True
        try:
            yield
        finally:
            self._in_device_work = False

    def close(self) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


@dataclasses.dataclass
class Live:
    """A request: ``written`` tokens are in the cache, ``prompt`` tokens wait for prefill,
    ``next`` is the token to write next (sampled, not yet written), ``left`` tokens to generate."""

    written: list[int]
    prompt: list[int]
    next: int
    left: int


class LoadRun:
    def __init__(self, seed: int, checkpoint_every: float, lowered: Lowered) -> None:
        self.rng = np.random.default_rng(seed)
        self.lowered = lowered
        self.mesh = create_mesh({"tp": 8})
        self.pm = PartitionManager(PartitionAxis())
        self.model = CompiledModel(demo_model("uniform"))  # its steps replicate the parameters over the mesh once
        cfg = self.model.cfg
        meta = easykv.PagedAttentionCacheMetaData.create(
            self.mesh, SEQS, cfg.layers, MAX_LEN, PAGE, cfg.kv_heads, cfg.head_dim, 0.9, jnp.float32,
            partition_manager=self.pm, num_pages_per_layer=POOL).replace(host_pages_per_layer=HOST_POOL)
        cache = easykv.PagedAttentionCache.init_cache(self.mesh, jnp.float32, meta, self.pm)
        self.tier = easykv.HostTier(cache)
        self.manager = easykv.PageManager(meta, scrub_released=True)
        self.runner = easykv.Runner(self.manager, cache, host=self.tier)  # holds the cache from now on
        self.live: dict[int, Live] = {}
        self.version = 0
        self.checkpoint_every, self.last_checkpoint = checkpoint_every, time.perf_counter()
        self.counts = dict.fromkeys(("steps", "plans", "tokens", "arrivals", "forks", "truncations", "releases",
                                     "versions", "swap_outs", "swap_ins", "preemptions", "checkpoints", "restores"), 0)
        self.device_time = 0.0  # seconds of the current iteration in calls that run device programs
        self.saves: list[float] = []
        self.first_restore = 0.0  # when the first checkpoint was restored (0: not yet)
        self.compile_steps(meta)

    @property
    def cache(self) -> easykv.PagedAttentionCache:
        """The live cache (the runner's)."""
        return self.runner.cache

    def compile_steps(self, meta: easykv.PagedAttentionCacheMetaData) -> None:
        """The model's step and decode loop compiled on a scratch cache of the same pool, so the
        load starts warm (their programs are counted all the same)."""
        cache = easykv.PagedAttentionCache.init_cache(self.mesh, jnp.float32, meta, self.pm)
        manager = easykv.PageManager(meta)
        [s] = manager.claim(1)
        plan = manager.schedule([s], [3], pad_tokens_to=BUDGET, pad_seqs_to=SEQS)  # a fresh pool: no device work
        logits, cache = self.model.paged_step(cache, np.arange(BUDGET, dtype=np.int32), plan.metadata)
        _greedy(logits, np.zeros(SEQS, np.int32))
        manager.commit(plan, [[1, 2, 3]])
        plan = manager.schedule_decode([s], DECODE_STEPS, pad_seqs_to=SEQS)
        out = self.model.paged_decode(cache, np.zeros(SEQS, np.int32), plan, np.asarray(plan.limits, np.int32))
        written, counts = jax.device_get((out.written, out.num_written))
        manager.commit(plan, written, counts)

    # ---- events ----------------------------------------------------------------------------------
    def running(self) -> list[int]:
        swapped = set(self.manager.swapped_ids)
        return [s for s in self.live if s not in swapped]

    def decoding(self) -> list[int]:
        return [s for s in self.running() if not self.live[s].prompt]

    def events(self) -> None:
        rng, m = self.rng, self.manager
        draws = {name: rng.random() < p for name, p in EVENTS.items()}
        if draws["arrive"] and m.slots_remaining:
            self.arrive()
        if draws["fork"] and self.decoding() and m.slots_remaining:
            parent = int(rng.choice(self.decoding()))
            child = m.fork(parent)
            p = self.live[parent]
            self.live[child] = Live(list(p.written), [], int(rng.integers(32, 127)), int(rng.integers(4, 48)))
            self.counts["forks"] += 1
        if draws["truncate"] and (long := [s for s in self.decoding() if len(self.live[s].written) > 2]):
            s = int(rng.choice(long))
            keep = int(rng.integers(1, len(self.live[s].written)))
            m.truncate(s, keep)
            r = self.live[s]
            r.written, r.next = r.written[:keep], r.written[keep]  # write the dropped position again
            self.counts["truncations"] += 1
        if draws["drop"] and self.live:
            self.release(int(rng.choice(list(self.live))))
        if draws["version"]:
            self.version += 1
            m.set_weight_version(self.version)
            self.counts["versions"] += 1
        if draws["swap_out"] and len(self.running()) > 1:
            self.swap_out(int(rng.choice(self.running())))
        if draws["swap_in"] and m.swapped_ids:
            self.apply()  # a swap-out still pending lands first
            try:
                m.swap_in(m.swapped_ids[0])
                self.counts["swap_ins"] += 1
            except CacheFullError:
                pass

    def arrive(self) -> None:
        rng, m = self.rng, self.manager
        [s] = m.claim(1)
        tail = rng.integers(32, 127, int(rng.integers(0, 48))).tolist()
        prompt = encode(SYSTEM_PROMPT + OPENINGS[int(rng.integers(len(OPENINGS)))]) + tail
        if len(prompt) % PAGE == 0:  # a prefix hit covers whole pages only: one token is always left to prefill
            prompt.append(int(rng.integers(32, 127)))
        done = m.match_prefix(s, prompt)
        self.live[s] = Live(prompt[:done], prompt[done:], 0, int(rng.integers(8, 64)))
        self.counts["arrivals"] += 1

    def release(self, s: int) -> None:
        self.manager.release(s)
        del self.live[s]
        self.counts["releases"] += 1

    def swap_out(self, s: int) -> None:
        """To the host tier; released when the host tier is full."""
        self.apply()  # its pages are complete before they move
        try:
            self.manager.swap_out(s)
        except CacheFullError:
            self.release(s)
            return
        self.counts["swap_outs"] += 1

    def apply(self) -> None:
        """The work no plan took (a swap-out's offloads, a release's scrubs)."""
        with self.on_device(), self.lowered.counting_device_work():
            self.runner.apply_pending()

    def schedule(self, seqs: list[int], counts: list[int]) -> StepPlan:
        """The runner's `schedule`: the plan's device work applied at once, counted as device work
        (its host-side scheduling, a small part, counted with it)."""
        with self.on_device(), self.lowered.counting_device_work():
            return self.runner.schedule(seqs, counts, pad_tokens_to=BUDGET, pad_seqs_to=SEQS)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """Time spent dispatching device programs and waiting for them: on CPU the "device" runs
        on the host's cores, so only the rest of a step is its host-side scheduling."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.device_time += time.perf_counter() - start

    # ---- one engine step -------------------------------------------------------------------------
    def step(self) -> None:
        running = self.running()
        if not running:
            return
        if all(not self.live[s].prompt for s in running) and self.decode_plan(running):
            return
        self.mixed_step(running)

    def mixed_step(self, running: list[int]) -> None:
        """Decodes (one token each) and prefill chunks in one jitted step of ``BUDGET`` tokens;
        a step that does not fit preempts its newest request to the host tier."""
        batch = self.batch(running)
        while True:
            seqs, feed = [s for s, _ in batch], [t for _, t in batch]
            try:
                plan = self.schedule(seqs, [len(t) for t in feed])
                break
            except CacheFullError:
                victim = seqs[-1]
                if len(batch) == 1:
                    self.release(victim)
                    return
                self.swap_out(victim)
                self.counts["preemptions"] += 1
                batch = batch[:-1]
        tokens = np.zeros(BUDGET, np.int32)
        flat = [t for ids in feed for t in ids]
        tokens[: len(flat)] = flat
        ends = np.zeros(SEQS, np.int32)  # fixed shapes (numpy: jnp.asarray would compile per shape)
        ends[: len(feed)] = np.cumsum([len(t) for t in feed]) - 1

        def model_step(cache: easykv.PagedAttentionCache, plan: StepPlan) -> tuple[object, np.ndarray]:
            with self.on_device():
                logits, cache = self.model.paged_step(cache, tokens, plan.metadata)
                return cache, np.asarray(jax.device_get(_greedy(logits, ends)))[: len(feed)]

        sampled = self.runner.run(plan, model_step, token_ids=feed)  # its commit: feed, as written
        self.counts["steps"] += 1
        for s, ids, token in zip(seqs, feed, sampled.tolist()):
            r = self.live[s]
            r.written += ids
            if r.prompt:
                r.prompt = r.prompt[len(ids):]
                if r.prompt:
                    continue  # mid-prompt chunk: nothing sampled yet
            else:
                self.counts["tokens"] += 1
                r.left -= 1
            r.next = int(token)
            self.finish_if_done(s)

    def batch(self, running: list[int]) -> list[tuple[int, list[int]]]:
        budget, batch = BUDGET, []
        for s in running:
            r = self.live[s]
            if not r.prompt and len(r.written) < MAX_LEN and len(batch) < SEQS:
                batch.append((s, [r.next]))
                budget -= 1
        for s in running:
            r = self.live[s]
            if r.prompt and budget > 0 and len(batch) < SEQS:
                chunk = r.prompt[: min(budget, 32)]
                batch.append((s, chunk))
                budget -= len(chunk)
        return batch

    def decode_plan(self, running: list[int]) -> bool:
        """Up to ``DECODE_STEPS`` decode steps of every running request in one device loop;
        False (nothing changed) when the plan does not fit."""
        seqs = [s for s in running if len(self.live[s].written) < MAX_LEN][:SEQS]
        if not seqs:
            return False
        most = [min(DECODE_STEPS, self.live[s].left, MAX_LEN - len(self.live[s].written)) for s in seqs]
        try:
            with self.on_device(), self.lowered.counting_device_work():
                plan = self.runner.schedule_decode(seqs, DECODE_STEPS, max_tokens=most, pad_seqs_to=SEQS)
        except CacheFullError:
            return False
        tokens = np.zeros(SEQS, np.int32)
        tokens[: len(seqs)] = [self.live[s].next for s in seqs]

        def loop(cache: easykv.PagedAttentionCache, plan: StepPlan) -> tuple[object, tuple]:
            with self.on_device():
                out = self.model.paged_decode(cache, tokens, plan, np.asarray(plan.limits, np.int32))
                return out.state, jax.device_get((out.written, out.sampled, out.num_written))

        # the runner commits what each row wrote, or aborts the plan on any failure (its sequences stay usable)
        written, sampled, counts = self.runner.run(plan, loop, token_ids=lambda out: out[0],
                                                   num_tokens=lambda out: out[2])
        self.counts["plans"] += 1
        self.counts["steps"] += 1
        for i, s in enumerate(seqs):
            n, r = int(counts[i]), self.live[s]
            if n:
                r.written += written[i, :n].tolist()
                r.next, r.left = int(sampled[i, n - 1]), r.left - n
                self.counts["tokens"] += n
            self.finish_if_done(s)
        return True

    def finish_if_done(self, s: int) -> None:
        r = self.live[s]
        if r.left <= 0 or len(r.written) >= MAX_LEN:
            self.release(s)

    # ---- checkpoints -----------------------------------------------------------------------------
    def checkpoint_due(self) -> bool:
        return time.perf_counter() - self.last_checkpoint >= self.checkpoint_every

    def checkpoint(self) -> None:
        """Swapped requests come back (or are dropped: a checkpoint holds device pages only),
        then ``save_cache``; every second save is restored and compared with what was saved."""
        m = self.manager
        self.apply()  # swap-outs still pending land first
        for s in list(m.swapped_ids):
            try:
                m.swap_in(s)
            except CacheFullError:
                self.release(s)
        self.apply()
        with tempfile.TemporaryDirectory() as directory, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="the checkpoint leaves out the host-memory tier")
            start = time.perf_counter()
            easykv.save_cache(directory, self.cache, m)
            self.saves.append(time.perf_counter() - start)
            self.counts["checkpoints"] += 1
            if self.counts["checkpoints"] % 2 == 0:
                self.compare(easykv.restore_cache(directory, mesh=self.mesh, partition_manager=self.pm))
                self.first_restore = self.first_restore or time.perf_counter()
        self.last_checkpoint = time.perf_counter()

    def compare(self, restored: object) -> None:
        cache, manager = restored  # type: ignore[misc]
        live = jax.tree.leaves((self.cache.key_pages, self.cache.value_pages))
        back = jax.tree.leaves((cache.key_pages, cache.value_pages))
        if len(live) != len(back) or not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(live, back)):
            raise AssertionError("a restored checkpoint's pages differ from the cache that was saved")
        manager.check_invariants()
        ids = self.manager.active_ids
        if manager.active_ids != ids or any(manager.length(s) != self.manager.length(s) for s in ids) or (
                ids and not np.array_equal(manager.page_table(ids), self.manager.page_table(ids))):
            raise AssertionError("a restored checkpoint's sequences differ from the ones that were saved")
        self.counts["restores"] += 1

    # ---- the end ---------------------------------------------------------------------------------
    def drain(self) -> list[str]:
        """Release everything, empty the prefix cache and apply the scrubs; the ways the end
        state is not "every page free and zero" (empty when it is)."""
        m = self.manager
        for s in list(self.live):
            self.release(s)
        m.reset_prefix_cache()
        self.apply()
        self.tier.flush()
        m.check_invariants()
        metrics, problems = m.metrics, []
        if metrics.used_pages or metrics.cached_pages or metrics.free_pages != metrics.total_pages:
            problems.append(f"device pages: {metrics.used_pages} used, {metrics.cached_pages} cached, "
                            f"{metrics.free_pages} free of {metrics.total_pages}")
        host = metrics.host
        if host is not None and (host.used_pages or host.cached_pages or host.free_pages != host.total_pages):
            problems.append(f"host pages: {host.used_pages} used, {host.cached_pages} cached, "
                            f"{host.free_pages} free of {host.total_pages}")
        if m.active_ids or m.has_pending_work:
            problems.append(f"sequences {m.active_ids} active, pending work {m.has_pending_work}")
        dirty = sum(int(np.count_nonzero(np.asarray(a))) for a in jax.tree.leaves((self.cache.key_pages,
                                                                                    self.cache.value_pages)))
        if dirty:
            problems.append(f"{dirty} nonzero values left in the device pages after every page was scrubbed")
        if self.tier.host_bytes and any(np.count_nonzero(a) for store in self.tier._groups
                                        for shards in store.shards for a in shards.values()):
            problems.append("host pages hold data after every host page was scrubbed")
        return problems


def slope_mib_per_minute(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    if len(points) < 2:
        return 0.0
    t = np.array([p[0] for p in points])
    r = np.array([p[1] for p in points])
    return float(np.polyfit(t, r, 1)[0] * 60)


def memory_after_warm_up(samples: list[Sample], warm: Census, end: Census) -> dict:
    """Growth and slopes from the census that closes warm-up to the end: VmRSS, RssAnon and
    malloc's held and kept MiB (slopes over the whole window and over its last half)."""
    after = [s for s in samples if s.t >= warm.sample.t] + [end.sample]
    half = (warm.sample.t + end.sample.t) / 2
    out = {}
    for name in ("rss", "anon", "held", "kept"):
        out[f"{name}_growth"] = getattr(end.sample, name) - getattr(warm.sample, name)
        out[f"{name}_slope"] = slope_mib_per_minute([(s.t, getattr(s, name)) for s in after])
        out[f"{name}_slope_half"] = slope_mib_per_minute([(s.t, getattr(s, name)) for s in after if s.t >= half])
    return out


def run(seconds: float, checkpoint_every: float, sample_every: int, seed: int) -> dict:
    """``seconds`` of load after the setup (model, cache, manager); the clock of the lowered
    programs and the memory samples starts with the load. A `Sample` every ``sample_every``
    iterations; a `Census` every ``seconds / CENSUSES`` from the first quarter on (the first one
    after warm-up opens the comparison) and one at the end, before anything is released."""
    lowered = Lowered()
    load = LoadRun(seed, checkpoint_every, lowered)
    host_times, walls, samples, censuses = [], [], [], []
    start, i, next_census = time.perf_counter(), 0, seconds / 4
    load.last_checkpoint = start
    while (now := time.perf_counter() - start) < seconds:
        t0 = time.perf_counter()
        load.device_time = 0.0
        if load.checkpoint_due():
            load.checkpoint()
        else:
            load.events()
            load.step()
            wall = time.perf_counter() - t0
            walls.append(wall)
            host_times.append(wall - load.device_time)
        if i % sample_every == 0:
            samples.append(Sample.take(now))
        if now >= next_census:
            censuses.append(Census.take(now))
            next_census += seconds / CENSUSES
        i += 1
    jax.block_until_ready(load.cache)
    end = Census.take(time.perf_counter() - start)
    problems = load.drain()
    lowered.close()
    warm_up = max(seconds / 4, load.first_restore - start)
    warm = next((c for c in censuses if c.sample.t >= warm_up), end)
    late = [name for t, name in lowered.programs if t >= start + warm.sample.t]
    return dict(
        load=load, iterations=i, seconds=time.perf_counter() - start, problems=problems,
        device_work=lowered.device_work, lowered=len(lowered.programs), lowered_after=late,
        warm=warm, end=end, memory=memory_after_warm_up(samples, warm, end), samples=[*samples, end.sample],
        host_ms=1e3 * statistics.median(host_times), wall_ms=1e3 * statistics.median(walls),
        save_ms=1e3 * statistics.median(load.saves) if load.saves else float("nan"))


def print_curve(samples: list[Sample], every: float) -> None:
    """The first sample of each ``every`` seconds, and the last."""
    print(f"\n{'t (s)':>7} {'VmRSS':>7} {'RssAnon':>8} {'held':>7} {'kept':>7}   (MiB; held/kept: malloc's)")
    mark = 0.0
    for s in samples:
        if s.t >= mark or s is samples[-1]:
            print(f"{s.t:7.0f} {s.rss:7.1f} {s.anon:8.1f} {s.held:7.1f} {s.kept:7.1f}")
            mark = (s.t // every + 1) * every


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=None, help="seconds of load (default 300; --quick: 20)")
    parser.add_argument("--quick", action="store_true", help="20 s of load: checks the script runs (CI)")
    parser.add_argument("--checkpoint-every", type=float, default=None,
                        help="seconds between checkpoints (default 15; --quick: 6)")
    parser.add_argument("--rss-slack", type=float, default=64.0,
                        help="MiB the RSS may grow after warm-up (default 64)")
    parser.add_argument("--heap-slack", type=float, default=16.0,
                        help="MiB the heap malloc has handed out (held) may grow after warm-up (default 16)")
    parser.add_argument("--curve", type=float, default=None, metavar="SECONDS",
                        help="also print the memory samples, one every SECONDS")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    seconds = args.seconds if args.seconds is not None else (20.0 if args.quick else 300.0)
    every = args.checkpoint_every if args.checkpoint_every is not None else (6.0 if args.quick else 15.0)
    r = run(seconds, every, sample_every=25, seed=args.seed)
    load, c = r["load"], r["load"].counts
    bound = 2 + math.log2(POOL)
    work, mem, warm, end = r["device_work"], r["memory"], r["warm"].sample, r["end"].sample
    late = r["lowered_after"]
    has_malloc = not math.isnan(mem["held_growth"])
    rows = [
        ("load", f"{r['seconds']:.0f} s, {r['iterations']} iterations, warm-up {warm.t:.0f} s", ""),
        ("engine steps (device loops)", f"{c['steps']} ({c['plans']} plans of up to {DECODE_STEPS})", ""),
        ("tokens generated", f"{c['tokens']}", ""),
        ("arrivals / forks / truncations", f"{c['arrivals']} / {c['forks']} / {c['truncations']}", ""),
        ("releases / weight versions", f"{c['releases']} / {c['versions']}", ""),
        ("swap-outs (preemptions) / swap-ins", f"{c['swap_outs']} ({c['preemptions']}) / {c['swap_ins']}", ""),
        ("checkpoints saved / restored and compared", f"{c['checkpoints']} / {c['restores']}", ""),
        ("pages scrubbed / copied", f"{load.manager.metrics.scrubs} / {load.manager.metrics.copies}", ""),
        ("programs compiled inside apply_pending", f"{len(work)} ({', '.join(sorted(set(work)))})",
         f"<= 2 + log2({POOL}) = {bound:.0f}"),
        ("programs lowered (all / after warm-up)",
         f"{r['lowered']} / {len(late)}" + (f" ({', '.join(sorted(set(late)))})" if late else ""), ""),
        ("RSS after warm-up -> end", f"{warm.rss:.0f} -> {end.rss:.0f} MiB ({mem['rss_growth']:+.1f})",
         f"growth <= {args.rss_slack:.0f} MiB"),
        ("RSS slope after warm-up (all / last half)",
         f"{mem['rss_slope']:+.2f} / {mem['rss_slope_half']:+.2f} MiB/min", ""),
        ("RssAnon after warm-up -> end", f"{warm.anon:.0f} -> {end.anon:.0f} MiB ({mem['anon_growth']:+.1f}; "
         f"last half {mem['anon_slope_half']:+.2f} MiB/min)", ""),
        ("malloc: held after warm-up -> end",
         f"{warm.held:.1f} -> {end.held:.1f} MiB ({mem['held_growth']:+.1f}; last half "
         f"{mem['held_slope_half']:+.2f} MiB/min)" if has_malloc else "n/a (no glibc mallinfo2)",
         f"growth <= {args.heap_slack:.0f} MiB" if has_malloc else ""),
        ("malloc: free but kept after warm-up -> end",
         f"{warm.kept:.0f} -> {end.kept:.0f} MiB ({mem['kept_growth']:+.1f})" if has_malloc else "n/a", ""),
        ("live jax arrays after warm-up -> end", f"{r['warm'].arrays} ({r['warm'].array_mib:.1f} MiB) -> "
         f"{r['end'].arrays} ({r['end'].array_mib:.1f} MiB)", ""),
        ("Python objects after warm-up -> end",
         f"{r['warm'].objects:,} -> {r['end'].objects:,} ({r['end'].objects - r['warm'].objects:+,})", ""),
        ("host time per step (median)", f"{r['host_ms']:.2f} ms (wall {r['wall_ms']:.2f} ms)", ""),
        ("checkpoint save (median)", f"{r['save_ms']:.0f} ms", ""),
        ("end: every page free and zero", "yes" if not r["problems"] else "; ".join(r["problems"]), "yes"),
    ]
    width, vwidth = max(len(n) for n, _, _ in rows), max(len(v) for _, v, _ in rows)
    print(f"{'bench_load':<{width}}  {'result':<{vwidth}}  target")
    print("-" * (width + vwidth + 30))
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:<{vwidth}}  {target}")
    missed = [name for name, ok in (
        ("programs compiled inside apply_pending", len(r["device_work"]) <= bound),
        ("RSS growth after warm-up", mem["rss_growth"] <= args.rss_slack),
        ("malloc held growth after warm-up", not has_malloc or mem["held_growth"] <= args.heap_slack),
        ("every page free and zero", not r["problems"]),
    ) if not ok]
    if args.curve:
        print_curve(r["samples"], args.curve)
    if missed:
        print(f"MISSED: {', '.join(missed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
