"""``stepstone bench``: the benchmark suite, against fresh databases on the configured server."""

from __future__ import annotations

from pathlib import Path

import click

from stepstone.bench.common import BenchContext, Sizes
from stepstone.cli.common import CliError, with_settings
from stepstone.config import Settings
from stepstone.errors import StepstoneError
from stepstone.store.database import resolve_target
from stepstone.store.embedded import pg_bin_dir

__all__ = ["commands"]


@click.command("bench")
@click.option("--quick", is_flag=True, help="CI size (about 30 s) instead of the full size.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the JSON report here.")
@click.option("--only", default=None, metavar="A,B",
              help="Run only these workloads (ceiling, throughput, latency, enqueue, scale, recovery, memory, relay, "
                   "fanout, external, api).")
@click.option("--concurrency", type=click.IntRange(1, 10_000), default=8, show_default=True,
              help="Worker slots, and pgbench clients for the ceiling.")
@click.option("--processes", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Also measure throughput with this many worker processes.")
@with_settings
def bench_command(
    settings: Settings, quick: bool, out: Path | None, only: str | None, concurrency: int, processes: int
) -> None:
    """Measure throughput, latency, enqueue, scale, recovery, memory and fan-out against a same-run pgbench ceiling.

    Each workload gets a fresh database stepstone_bench_<random>, created on the configured server (or
    the embedded default) and dropped afterwards.
    """
    from stepstone.bench import runner  # noqa: PLC0415 - keep the CLI's start-up light
    names = list(runner.WORKLOADS)
    if only:
        wanted = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in runner.WORKLOADS]
        if unknown:
            raise CliError(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(names)}")
        names = [n for n in names if n in wanted]
    try:
        target = resolve_target(settings)
    except StepstoneError as exc:
        raise CliError(str(exc)) from exc
    bench = BenchContext(
        admin_url=target.url, schema=settings.schema, sizes=Sizes.quick() if quick else Sizes.full(),
        concurrency=concurrency, processes=processes, bin_dir=str(pg_bin_dir()),
    )
    report = runner.run(bench, names)
    click.echo(runner.table(report))
    if out is not None:
        runner.write(report, out)
        click.echo(f"wrote {out}")
    if report["errors"]:
        raise CliError(f"{len(report['errors'])} workload(s) failed: {', '.join(report['errors'])}")


commands = [bench_command]
