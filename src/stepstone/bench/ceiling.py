"""The same-run ceiling: pgbench committing the writes of one step commit as one statement.

One data-modifying CTE per transaction (fenced instance update, settle of the claimed command,
insert of the next, already claimed, command, STEP_COMPLETED history row) against the engine's own
tables and indexes, at the engine's concurrency. Every throughput is reported as a ratio to it.
The same script from one client is the floor for work done one round trip at a time (a start
awaited before the next): a commit waits for its WAL flush, so no one-at-a-time statement that
commits goes faster than that on the same server.
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from pathlib import Path

import asyncpg

from stepstone.bench.common import BenchContext, Metric, bench_database, bench_queries
from stepstone.store.dsn import without_password

_TPS = re.compile(r"^tps = ([0-9.]+)", re.MULTILINE)


async def run(ctx: BenchContext) -> list[Metric]:
    q = bench_queries(ctx.schema)
    async with bench_database(ctx) as url:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(q["ceiling_setup"], ctx.sizes.ceiling_instances)
            await conn.execute(q["analyze"])
        finally:
            await conn.close()
        with tempfile.TemporaryDirectory(prefix="stepstone-bench-") as tmp:
            script = Path(tmp) / "step_commit.sql"
            script.write_text(q["ceiling_script"] + "\n", encoding="utf-8")
            tps, output = await pgbench(ctx, url, script)
            serial, serial_output = await pgbench(ctx, url, script, clients=1)
    ctx.ceiling, ctx.serial_ceiling = tps, serial
    ctx.say(f"ceiling: pgbench {tps:,.0f} commits/s at {ctx.concurrency} clients, {serial:,.0f} from one client")
    return [
        Metric("ceiling", "pgbench step commits/s", tps, "commits/s", ratio=1.0,
               note=f"pgbench -c {ctx.concurrency} -j 2 -M prepared; {output}"),
        Metric("ceiling", "pgbench step commits/s, one client", serial, "commits/s", ratio=serial / tps,
               note=f"pgbench -c 1 -j 1 -M prepared; {serial_output}"),
    ]


def pgbench_command(
    ctx: BenchContext, url: str, script: Path, clients: int | None = None
) -> tuple[list[str], dict[str, str]]:
    """pgbench's arguments and environment: the password goes in PGPASSWORD, never on the command line.
    `clients` defaults to the engine's concurrency."""
    bare, password = without_password(url)
    clients = clients or ctx.concurrency
    args = [
        str(Path(ctx.bin_dir) / "pgbench"), "-n", "-f", str(script), "-c", str(clients), "-j", str(min(2, clients)),
        "-T", str(int(ctx.sizes.ceiling_seconds)), "-M", "prepared",
        "-D", f"instances={ctx.sizes.ceiling_instances}", bare,
    ]
    env = dict(os.environ)
    if password is not None:
        env["PGPASSWORD"] = password
    return args, env


async def pgbench(ctx: BenchContext, url: str, script: Path, clients: int | None = None) -> tuple[float, str]:
    """Run the script for the sized duration; (tps, pgbench's latency line)."""
    args, env = pgbench_command(ctx, url, script, clients)
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    out, err = await proc.communicate()
    text = out.decode()
    found = _TPS.search(text)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"pgbench failed ({proc.returncode}): {err.decode().strip()[-500:]}")
    latency = next((line.strip() for line in text.splitlines() if line.startswith("latency average")), "")
    return float(found.group(1)), latency
