"""The chaos scenarios. Each creates its own database on a target server, runs worker processes against it
while doing violence, then hands the tables to the checker and returns a JSON-able report.

    kills      SIGKILL a random worker every 0.2-1.0 s and start a new one
    zombies    SIGSTOP a worker in the middle of a handler for 1.5 x lease + 0.5 s, ten times
    partitions the same, but the worker runs on while its own proxy to PostgreSQL forwards nothing
    restarts   pg_ctl restart -m fast / -m immediate mid-run (a server the rig owns only)
    cuts       a proxy resets every connection every ~2 s, blackholes all traffic once for 6 s, and the
               LISTEN connections are terminated; new work must still be found (how fast is reported)
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg

from stepstone.client import Client
from stepstone.core.pin import pin_of
from stepstone.store.migrate import migrate
from stepstone.store.postgres import PostgresStore
from tests._pg import url_for
from tests.chaos import workflows
from tests.chaos.rig import checker
from tests.chaos.rig.driver import TaskDriver
from tests.chaos.rig.fleet import Fleet, serves
from tests.chaos.rig.mutation import unfenced_commit_segment
from tests.chaos.rig.proxy import Proxy
from tests.chaos.rig.server import RigServer

SCENARIOS = ("kills", "zombies", "partitions", "restarts", "cuts")


@dataclass
class Target:
    """Where a scenario runs: a server's admin URL, and the server itself when the rig owns it."""

    admin_url: str
    server: RigServer | None = None


@dataclass
class Options:
    size: int = 200
    workers: int = 4
    lease: float = 2.0
    concurrency: int = 8
    poll: float = 1.0
    seed: int = 1
    workdir: Path = field(default_factory=lambda: Path("results"))
    timeout: float | None = None
    mutate_fencing: bool = False  # zombies only: run with commit_decision's fence removed (checker must fail)
    fans: float = 0.05  # share of the workflows that are fan-outs (chaosfan-K)
    parents: float = 0.05  # share that are parents starting a child (chaosparent-1)
    tasks: float = 0.05  # share that are human tasks with a correlated message (chaostask-1; the driver acts)
    pauses: int = 10  # zombies
    restarts: tuple[str, ...] = ("fast", "immediate")  # restarts
    keep_database: bool = False  # leave the scenario's database behind for inspection


# -- database set-up --------------------------------------------------------------------------------


async def create_database(admin_url: str, name: str) -> str:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = url_for(admin_url, name)
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn, "stepstone")
        await conn.execute(workflows.LEDGER_DDL)
    finally:
        await conn.close()
    return url


async def drop_database(admin_url: str, name: str) -> None:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def workload(n: int, rng: random.Random, fans: float, parents: float,
             tasks: float = 0.0) -> list[tuple[Any, dict[str, Any]]]:
    """`n` top-level workflows in a shuffled mix: chains of 1-5 steps, fan-outs over 4-8 items (`fans` of
    them, at least one when the share is not 0), parents of one child each (`parents`, likewise), human
    tasks each then waiting for its correlated message (`tasks`, likewise; each with a key of its own)."""
    n_fans = max(1, round(n * fans)) if fans > 0 and n >= 3 else 0
    n_parents = max(1, round(n * parents)) if parents > 0 and n >= 3 else 0
    n_tasks = max(1, round(n * tasks)) if tasks > 0 and n >= 3 else 0
    mix: list[tuple[Any, dict[str, Any]]] = [(workflows.PARENT, {}) for _ in range(n_parents)]
    mix += [(workflows.TASK, {"key": f"t-{rng.getrandbits(64):016x}"}) for _ in range(n_tasks)]
    for _ in range(n_fans):
        k = rng.randint(*workflows.FAN_ITEMS)
        mix.append((workflows.FANS[k], {"items": list(range(k))}))
    mix += [(workflows.CHAINS[rng.randint(1, workflows.MAX_STEPS)], {}) for _ in range(n - len(mix))]
    rng.shuffle(mix)
    return mix


async def start_instances(url: str, n: int, rng: random.Random, fans: float = 0.0, parents: float = 0.0,
                          tasks: float = 0.0) -> list[str]:
    store = await PostgresStore.open(url, max_size=8)
    try:
        client = Client(store, workflows.registry)
        for wf in workflows.registry:
            await store.register(pin_of(wf), wf.plan.document())
        ids: list[str] = []
        mix = workload(n, rng, fans, parents, tasks)
        for lo in range(0, n, 64):
            batch = mix[lo:lo + 64]
            ids += await asyncio.gather(*(client.start(wf, state) for wf, state in batch))
        return ids
    finally:
        await store.close()


class Probe:
    """A reconnecting connection for the rig's own polling (the server may be restarting). Callers may
    share it from concurrent tasks (a test's kills and its own waits): they take turns, since a second
    query on a busy connection fails like a lost one, and the reconnect would leave it open."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: asyncpg.Connection | None = None
        self.turn = asyncio.Lock()

    async def fetchval(self, sql: str, *args: Any) -> Any:
        async with self.turn:
            return await self._fetchval(sql, *args)

    async def _fetchval(self, sql: str, *args: Any) -> Any:
        while True:
            try:
                if self.conn is None or self.conn.is_closed():
                    self.conn = await asyncpg.connect(self.url, timeout=5)
                return await self.conn.fetchval(sql, *args, timeout=10)
            except (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
                    asyncpg.exceptions.OperatorInterventionError, TimeoutError):
                self.conn = None
                await asyncio.sleep(0.1)  # the server is coming back; retry the probe

    async def completed(self) -> int:
        """Top-level instances completed (a child is counted with its parent)."""
        return int(await self.fetchval(
            "SELECT count(*) FROM stepstone.instances WHERE status = 'COMPLETED' AND parent_id IS NULL"))

    async def commits(self) -> int:
        return int(await self.fetchval("SELECT count(*) FROM stepstone.history WHERE kind = 'STEP_COMPLETED'"))

    async def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()


async def progressed(probe: Probe, since: int, steps: int, deadline: float, done: Any = None,
                     count: Callable[[], Awaitable[int]] | None = None) -> int:
    """Wait until `steps` more steps than `since` have committed (or `done()` says the run is over):
    a schedule paced by the engine's own progress, not by the clock. The count of commits then.
    `count` counts the progress instead of the step commits (e.g. every history entry)."""
    counting = count or probe.commits

    async def moved() -> bool:
        return await counting() >= since + steps or (done is not None and bool(await done()))

    await wait_for(moved, deadline, every=0.01)
    return await counting()


async def kill_as_commits_go(fleet: Fleet, probe: Probe, done: Any, *, kills: int, every: int, rng: random.Random,
                             deadline: float, count: Callable[[], Awaitable[int]] | None = None) -> None:
    """SIGKILL a random worker of `fleet` (and start another in its place) after every `every` step commits
    (or `count()` moved on by `every`), `kills` times, or until `done()` says the run is over or the deadline
    passes: kills paced by the engine's own progress, so they fall while work runs however fast or slow the
    machine is."""
    commits = await (count or probe.commits)()
    while time.monotonic() < deadline and len(fleet.kills) < kills and not await done():
        commits = await progressed(probe, commits, every, deadline, done, count)
        fleet.kill(rng.randrange(fleet.size))


@contextlib.asynccontextmanager
async def fleet_run(fleet: Fleet, probe: Probe, *also: Callable[[], Awaitable[Any]]) -> AsyncIterator[None]:
    """The frame of a kill test's run: however the body ends, close `also` (in order), then the probe,
    then stop the fleet (in a thread: SIGTERM and a drain, while the loop stays free); and when the body
    ended normally, fail if a worker exited on its own (a crash is not a kill)."""
    try:
        yield
    finally:
        for close in also:
            await close()
        await probe.close()
        await asyncio.to_thread(fleet.stop)
    assert fleet.crashed() == [], f"workers exited on their own: {fleet.crashed()}"


async def wait_for(predicate: Any, deadline: float, every: float = 0.2) -> bool:
    """Poll an async predicate until true or the monotonic deadline passes."""
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(every)
    return bool(await predicate())


@contextlib.asynccontextmanager
async def scenario_database(target: Target, name: str, keep: bool = False) -> AsyncIterator[str]:
    db = f"chaos_{name}_{uuid.uuid4().hex[:8]}"
    url = await create_database(target.admin_url, db)
    try:
        yield url
    finally:
        if not keep:
            await drop_database(target.admin_url, db)


async def _finish(url: str, fleet: Fleet, driver: TaskDriver, opts: Options, *, expected: int,
                  pauses: list[dict[str, Any]], started: float, extra: dict[str, Any]) -> dict[str, Any]:
    await driver.stop()
    await asyncio.to_thread(fleet.stop)  # in a thread: a proxy on this loop must keep forwarding meanwhile
    stats = fleet.stats()
    fenced = [{**f, "pid": s["pid"]} for s in stats for f in s.get("fenced_log", [])]
    conn = await asyncpg.connect(url)
    try:
        report = await checker.check(conn, expected=expected, kills=fleet.kills, pauses=pauses, fenced=fenced,
                                     lease=opts.lease)
    finally:
        await conn.close()
    crashed = fleet.crashed()
    if crashed:
        report["violations"].append(f"worker_crashed: pids {crashed} exited on their own")
    # A kill can catch at most `concurrency` handlers between their effect and their commit.
    if report["max_duplicates_of_one_kill"] > opts.concurrency:
        report["violations"].append("too_many_duplicates: one kill repeated more effects than it had handlers")
    report.update({
        "elapsed_s": round(time.monotonic() - started, 2),
        "worker_processes": len(stats),
        "fenced_commits": sum(s["fenced"] for s in stats),
        "unknown_outcome_commits": sum(s["unknown_outcome"] for s in stats),
        "worker_claims": sum(s["claims"] for s in stats),
        **driver.report(),
        "config": {"size": opts.size, "fans": opts.fans, "parents": opts.parents, "tasks": opts.tasks,
                   "workers": opts.workers,
                   "serves": [serves(n, opts.workers) for n in range(opts.workers)],
                   "lease_s": opts.lease, "concurrency": opts.concurrency, "poll_s": opts.poll, "seed": opts.seed},
        **extra,
    })
    return report


# -- kills ------------------------------------------------------------------------------------------


async def kills(target: Target, opts: Options) -> dict[str, Any]:
    rng = random.Random(opts.seed)  # noqa: S311 - a reproducible chaos schedule, not a secret
    started = time.monotonic()
    async with scenario_database(target, "kills", opts.keep_database) as url:
        await start_instances(url, opts.size, rng, opts.fans, opts.parents, opts.tasks)
        fleet = Fleet(url, opts.workdir / "kills", opts.workers, opts.lease, opts.concurrency, opts.poll,
                      env={workflows.PAUSE_ENV: "0.005"})
        fleet.start()
        driver = TaskDriver(url)
        driver.start()
        probe = Probe(url)
        deadline = time.monotonic() + (opts.timeout or 120 + opts.size * 0.06)
        try:
            # The kill schedule: every 0.2-1 s, but only once some instance completed since the last kill.
            # On a loaded machine a worker can take longer to start than the schedule lets it live, and
            # killing regardless then starved the whole fleet (a 600-instance run once hit its deadline).
            done_at_kill = -1
            while time.monotonic() < deadline and (done := await probe.completed()) < opts.size:
                await asyncio.sleep(rng.uniform(0.2, 1.0))
                if done > done_at_kill:
                    fleet.kill(rng.randrange(opts.workers))
                    done_at_kill = done
            await wait_for(lambda: _all_done(probe, opts.size), deadline)
        finally:
            await driver.stop()
            await probe.close()
        return await _finish(url, fleet, driver, opts, expected=opts.size, pauses=[], started=started, extra={})


async def _all_done(probe: Probe, n: int) -> bool:
    """Every instance has settled: COMPLETED, or FAILED/CANCELLED (which the checker reports as lost)."""
    moving = await probe.fetchval(
        "SELECT count(*) FROM stepstone.instances WHERE status NOT IN ('COMPLETED', 'FAILED', 'CANCELLED')")
    top = await probe.fetchval("SELECT count(*) FROM stepstone.instances WHERE parent_id IS NULL")
    return moving == 0 and top >= n


# -- zombies ----------------------------------------------------------------------------------------


async def zombies(target: Target, opts: Options) -> dict[str, Any]:
    return await _zombies(target, opts, partition=False)


async def partitions(target: Target, opts: Options) -> dict[str, Any]:
    """Like zombies, but the worker keeps running while the network between it and PostgreSQL is cut:
    its renewals and its commit sit in the network and arrive after another worker took over."""
    if target.server is None:
        raise Skip("partitions need a TCP server the rig owns to put a proxy per worker in front of")
    return await _zombies(target, opts, partition=True)


async def _zombies(target: Target, opts: Options, *, partition: bool) -> dict[str, Any]:
    rng = random.Random(opts.seed)  # noqa: S311 - a reproducible chaos schedule, not a secret
    started = time.monotonic()
    name = "partitions" if partition else "zombies"
    async with scenario_database(target, name, opts.keep_database) as url:
        if opts.mutate_fencing:
            conn = await asyncpg.connect(url)
            try:
                await conn.execute(unfenced_commit_segment())
            finally:
                await conn.close()
        total = min(opts.size, 1000)  # handlers linger 0.3 s here; more adds time, not coverage
        await start_instances(url, total, rng, opts.fans, opts.parents, opts.tasks)
        fleet = Fleet(url, opts.workdir / (f"{name}-mutant" if opts.mutate_fencing else name), opts.workers,
                      opts.lease, opts.concurrency, opts.poll, env={workflows.PAUSE_ENV: "0.3"})
        proxies: list[Proxy] = []
        if partition:
            assert target.server is not None
            db = urlsplit(url).path.lstrip("/")
            for slot in range(opts.workers):
                proxy = Proxy("127.0.0.1", target.server.port)
                await proxy.start()
                proxies.append(proxy)
                fleet.slot_urls[slot] = proxy.url(db)
        fleet.start()
        driver = TaskDriver(url)
        driver.start()
        probe = Probe(url)
        pauses: list[dict[str, Any]] = []
        # A pause lasts until another worker has run the paused step (its lease expired and was taken
        # over), then the zombie resumes and tries its writes. A fixed pause sometimes ended before any
        # worker took over (expired leases are found by polling), and such a pause tests nothing.
        most = 3 * opts.lease + opts.poll + 2.0
        deadline = time.monotonic() + (opts.timeout or 180 + opts.size * 0.2)
        try:
            while len(pauses) < opts.pauses and time.monotonic() < deadline:
                if await probe.completed() >= total - 10:  # keep work flowing for every pause
                    await start_instances(url, 50, rng, opts.fans, opts.parents, opts.tasks)
                    total += 50
                slot = rng.randrange(opts.workers)
                pid = fleet.procs[slot].pid
                # In the middle of a handler: its effect is committed and it is lingering before returning.
                key = await _handler_in_flight(probe, pid, time.monotonic() + 5)
                if key is None:
                    continue
                t0 = time.time()
                # A partitioned worker runs on, and nothing it sends or is sent arrives.
                cut, heal = ((proxies[slot].cut, proxies[slot].heal) if partition
                             else (lambda slot=slot: fleet.pause(slot), lambda slot=slot: fleet.resume(slot)))
                cut()
                try:
                    taken = await wait_for(lambda key=key, pid=pid: _taken_over(probe, key, pid),
                                           time.monotonic() + most, every=0.05)
                finally:
                    heal()
                pauses.append({"pid": pid, "from": t0, "to": time.time(), "taken_over": taken})
                await asyncio.sleep(0.5)  # let the zombie try its writes before the next pause
            # The mutant leaves instances stuck (a join counted twice waits forever): the checker needs
            # the tables, not the full deadline.
            settle = min(deadline, time.monotonic() + 5) if opts.mutate_fencing else deadline
            await wait_for(lambda: _all_done(probe, total), settle)
            await asyncio.to_thread(fleet.stop)  # while the proxies still forward their goodbyes
        finally:
            await driver.stop()
            await probe.close()
            for proxy in proxies:
                await proxy.close()
        report = await _finish(url, fleet, driver, opts, expected=total, pauses=pauses, started=started,
                               extra={"pauses": len(pauses), "taken_over": sum(p["taken_over"] for p in pauses),
                                      "pause_s": _mean([p["to"] - p["from"] for p in pauses]), "workflows": total,
                                      "mutated_fencing": opts.mutate_fencing})
        if not opts.mutate_fencing and report["fenced_commits"] == 0:
            report["violations"].append("no_zombie_write: no pause produced a fenced commit; nothing was tested")
        return report


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 2) if values else 0.0


async def _handler_in_flight(probe: Probe, pid: int, deadline: float) -> str | None:
    """The key of a step whose handler `pid` is running (its effect recorded in the last 150 ms)."""
    while time.monotonic() < deadline:
        key = await probe.fetchval(
            "SELECT key FROM chaos.ledger WHERE pid = $1 AND at > clock_timestamp() - interval '150 ms' "
            "ORDER BY at DESC LIMIT 1", pid)
        if key is not None:
            return str(key)
        await asyncio.sleep(0.02)
    return None


async def _taken_over(probe: Probe, key: str, pid: int) -> bool:
    """Another worker ran the step `pid` was paused in: it claimed the command after the lease expired."""
    return bool(await probe.fetchval("SELECT EXISTS (SELECT 1 FROM chaos.ledger WHERE key = $1 AND pid <> $2)",
                                     key, pid))


# -- restarts ---------------------------------------------------------------------------------------


async def restarts(target: Target, opts: Options) -> dict[str, Any]:
    server = target.server
    if server is None:
        raise Skip("restarts need a server the rig owns (pgdata and pg_ctl); the target is external")
    rng = random.Random(opts.seed)  # noqa: S311 - a reproducible chaos schedule, not a secret
    started = time.monotonic()
    async with scenario_database(target, "restarts", opts.keep_database) as url:
        await start_instances(url, opts.size, rng, opts.fans, opts.parents, opts.tasks)
        fleet = Fleet(url, opts.workdir / "restarts", opts.workers, opts.lease, opts.concurrency, opts.poll,
                      env={workflows.PAUSE_ENV: "0.005"})
        fleet.start()
        driver = TaskDriver(url)
        driver.start()
        probe = Probe(url)
        deadline = time.monotonic() + (opts.timeout or 180 + opts.size * 0.1)
        events: list[dict[str, Any]] = []
        try:
            for n, mode in enumerate(opts.restarts):
                goal = opts.size * (n + 1) // (len(opts.restarts) + 1)
                await wait_for(lambda goal=goal: _progress(probe, goal), deadline)
                before = await probe.commits()
                t0 = time.monotonic()
                await asyncio.to_thread(server.restart, mode)
                up = time.monotonic()
                resumed = await wait_for(lambda before=before: _committed_since(probe, before), deadline,
                                         every=0.02)
                first = time.monotonic()
                if not resumed:
                    raise AssertionError(f"no step committed after the {mode} restart before the deadline")
                events.append({"mode": mode, "resumed": resumed, "restart_s": round(up - t0, 3),
                               "first_commit_after_up_s": round(first - up, 3),
                               "first_commit_after_restart_began_s": round(first - t0, 3)})
            await wait_for(lambda: _all_done(probe, opts.size), deadline)
        finally:
            await driver.stop()
            await probe.close()
        return await _finish(url, fleet, driver, opts, expected=opts.size, pauses=[], started=started,
                             extra={"restarts": events})


async def _progress(probe: Probe, goal: int) -> bool:
    return await probe.completed() >= goal


async def _committed_since(probe: Probe, before: int) -> bool:
    return await probe.commits() > before


# -- cut connections --------------------------------------------------------------------------------


async def cuts(target: Target, opts: Options) -> dict[str, Any]:
    server = target.server
    if server is None:
        raise Skip("cuts need a TCP server the rig owns to put its proxy in front of")
    rng = random.Random(opts.seed)  # noqa: S311 - a reproducible chaos schedule, not a secret
    started = time.monotonic()
    async with scenario_database(target, "cuts", opts.keep_database) as url:
        await start_instances(url, opts.size, rng, opts.fans, opts.parents, opts.tasks)
        proxy = Proxy("127.0.0.1", server.port)
        await proxy.start()
        db = urlsplit(url).path.lstrip("/")
        fleet = Fleet(proxy.url(db), opts.workdir / "cuts", opts.workers, opts.lease, opts.concurrency, opts.poll,
                      env={workflows.PAUSE_ENV: "0.005"})
        fleet.start()
        driver = TaskDriver(url)
        driver.start()
        probe = Probe(url)  # direct, not through the proxy
        deadline = time.monotonic() + (opts.timeout or 180 + opts.size * 0.1)
        blackholed = False
        hole = (0.0, 0.0)
        reset_conns = 0
        try:
            await wait_for(lambda: _progress(probe, 1), deadline)
            while time.monotonic() < deadline and await probe.completed() < opts.size:
                await asyncio.sleep(rng.uniform(1.5, 2.5))  # the reset schedule
                reset_conns += proxy.reset_all()
                if not blackholed and await probe.completed() >= opts.size // 3:
                    blackholed = True
                    hole = await _blackhole(proxy, 6.0)
            await wait_for(lambda: _all_done(probe, opts.size), deadline)
            if not blackholed:  # a run too short to reach a third before the first reset
                hole = await _blackhole(proxy, 6.0)
                blackholed = True
            # The LISTEN connections die; new work must still be found within the poll interval.
            latencies = []
            extra = 0
            for _ in range(3):
                killed = await probe.fetchval(
                    "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND query ILIKE 'LISTEN%') t")
                await start_instances(url, 1, rng)
                extra += 1
                t0 = time.monotonic()
                await wait_for(lambda n=opts.size + extra: _progress(probe, n), deadline, every=0.02)
                latencies.append({"listen_killed": killed, "found_s": round(time.monotonic() - t0, 3)})
            await asyncio.to_thread(fleet.stop)  # while the proxy still forwards their goodbyes
        finally:
            await driver.stop()
            await probe.close()
            await proxy.close()
        # Every worker talks through the proxy: while it forwards nothing, nothing may commit. The edges
        # are left out (a commit sent just before the cut carries its transaction's start time).
        conn = await asyncpg.connect(url)
        try:
            during = await conn.fetchval(
                "SELECT count(*) FROM stepstone.history WHERE kind = 'STEP_COMPLETED' "
                "AND at BETWEEN to_timestamp($1) AND to_timestamp($2)", hole[0] + 0.5, hole[1] - 0.5)
        finally:
            await conn.close()
        report = await _finish(url, fleet, driver, opts, expected=opts.size + extra, pauses=[], started=started,
                               extra={"resets": proxy.resets, "connections_reset": reset_conns,
                                      "blackhole_s": round(hole[1] - hole[0], 3),
                                      "commits_during_blackhole": during, "after_listen_killed": latencies})
        # How fast new work is found once the LISTEN connections die is a figure (found_s), not a check.
        if not any(x["listen_killed"] for x in latencies):
            report["violations"].append("listen_not_found: no LISTEN connection was terminated")
        return report


async def _blackhole(proxy: Proxy, seconds: float) -> tuple[float, float]:
    """Blackhole the proxy; return the wall-clock window it forwarded nothing (epoch seconds)."""
    began = time.time()
    await proxy.blackhole(seconds)
    return began, time.time()


class Skip(Exception):
    """The scenario cannot run against this target (the reason is the message)."""


RUNNERS = {"kills": kills, "zombies": zombies, "partitions": partitions, "restarts": restarts, "cuts": cuts}
