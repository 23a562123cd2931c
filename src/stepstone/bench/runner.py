"""Run the workloads in order, print the table and write the JSON report."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg

from stepstone.bench import (
    api_list,
    ceiling,
    enqueue,
    external_tasks,
    fanout,
    latency,
    memory,
    recovery,
    relay,
    scale,
    throughput,
)
from stepstone.bench.common import BenchContext, Metric, bench_queries

Workload = Callable[[BenchContext], Awaitable[list[Metric]]]

WORKLOADS: dict[str, Workload] = {
    "ceiling": ceiling.run,
    "throughput": throughput.run,
    "latency": latency.run,
    "enqueue": enqueue.run,
    "scale": scale.run,
    "recovery": recovery.run,
    "memory": memory.run,
    "relay": relay.run,
    "fanout": fanout.run,
    "external": external_tasks.run,
    "api": api_list.run,
}
"""In run order: latency needs the throughput maximum, ratios need the ceiling."""


async def run_all(ctx: BenchContext, names: list[str]) -> dict[str, Any]:
    metrics: list[Metric] = []
    errors: dict[str, str] = {}
    started = time.monotonic()
    for name in names:
        print(f"{name} ...", flush=True)  # noqa: T201 - progress
        try:
            metrics += await WORKLOADS[name](ctx)
        except Exception as exc:  # noqa: BLE001 - one failing workload must not lose the others' numbers
            errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    return {
        "size": ctx.sizes.name,
        "machine": await machine(ctx.admin_url, ctx.schema),
        "concurrency": ctx.concurrency,
        "processes": ctx.processes,
        "seconds": round(time.monotonic() - started, 1),
        "metrics": [m.as_dict() for m in metrics],
        "errors": errors,
    }


async def machine(admin_url: str, schema: str) -> dict[str, Any]:
    conn = await asyncpg.connect(admin_url)
    try:
        server = await conn.fetchrow(bench_queries(schema)["server_settings"])
    finally:
        await conn.close()
    assert server is not None  # a SELECT without FROM returns one row
    version, sync, fsync = server["version"], server["synchronous_commit"], server["fsync"]
    memory_kb = _memory_kb()
    return {
        "nproc": os.cpu_count(), "memory_gib": round(memory_kb / 1024 / 1024, 1), "python": platform.python_version(),
        "postgresql": version, "synchronous_commit": sync, "fsync": fsync,
    }


def _memory_kb() -> int:
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return 0
    return int(meminfo.read_text().splitlines()[0].split()[1])


def table(report: dict[str, Any]) -> str:
    rows = [("workload", "metric", "value", "unit", "x ceiling", "target", "met")]
    for m in report["metrics"]:
        value = m.get("value")
        rows.append((
            m["workload"], m["name"], "-" if value is None else f"{value:,.2f}" if value < 100 else f"{value:,.0f}",
            m["unit"], f"{m['ratio']:.2f}" if "ratio" in m else "", m.get("target", ""),
            {True: "yes", False: "NO"}.get(m.get("met"), ""),
        ))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    lines += [f"FAILED {name}: {error}" for name, error in report["errors"].items()]
    return "\n".join(lines)


def write(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def run(ctx: BenchContext, names: list[str]) -> dict[str, Any]:
    return asyncio.run(run_all(ctx, names))
