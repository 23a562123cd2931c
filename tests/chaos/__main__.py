"""Run the chaos scenarios: ``python -m tests.chaos --scenario all --size 10000 --out results/``.

Without ``--admin-url`` the rig starts its own PostgreSQL (embedded binaries, TCP on 127.0.0.1) so every
scenario can run; with it, kills and zombies run there and restarts and cuts are skipped (they need a
server the rig owns). Writes ``<out>/<scenario>.json`` per scenario and exits 1 when any has violations.
Without ``--out`` the reports go to a new temporary directory, named at the end: ``results/`` holds the
tracked reports that docs/guarantees.md cites, and only a run meant to replace them names it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.chaos.rig import server as rig_server
from tests.chaos.rig.scenarios import RUNNERS, SCENARIOS, Options, Skip, Target


async def run(names: list[str], opts: Options, target: Target, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - one small write between scenarios
    results: dict[str, Any] = {}
    for name in names:
        t0 = time.monotonic()
        try:
            report = await RUNNERS[name](target, opts)
        except Skip as exc:
            report = {"skipped": str(exc)}
        report["scenario"] = name
        report["command"] = " ".join(["python -m tests.chaos", *sys.argv[1:]])
        report["wall_s"] = round(time.monotonic() - t0, 2)
        text = json.dumps(report, indent=2, default=str) + "\n"
        (out / f"{name}.json").write_text(text)
        results[name] = report
        status = "skipped" if "skipped" in report else ("FAIL" if report["violations"] else "ok")
        print(f"{name}: {status} in {report['wall_s']} s", file=sys.stderr)  # noqa: T201
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos")
    p.add_argument("--scenario", default="all", help=f"all or a comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--size", type=int, default=200, help="workflows per scenario (zombies cap at 1000)")
    p.add_argument("--out", default=None, help="where the reports go (default: a new temporary directory)")
    p.add_argument("--admin-url", default=None, help="run on this server instead of a dedicated one")
    p.add_argument("--lease", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fans", type=float, default=0.05, help="share of the workflows that are fan-outs")
    p.add_argument("--parents", type=float, default=0.05, help="share that are parents starting a child")
    p.add_argument("--tasks", type=float, default=0.05,
                   help="share that are human tasks with a correlated message (the rig completes and publishes)")
    p.add_argument("--restarts", type=int, default=2, help="server restarts, alternating -m fast / -m immediate")
    p.add_argument("--mutate-fencing", action="store_true", help="zombies with the fence removed (must fail)")
    args = p.parse_args(argv)
    names = list(SCENARIOS) if args.scenario == "all" else args.scenario.split(",")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="stepstone-chaos-"))
    opts = Options(size=args.size, workers=args.workers, lease=args.lease, concurrency=args.concurrency,
                   seed=args.seed, fans=args.fans, parents=args.parents, tasks=args.tasks, workdir=out / "work",
                   mutate_fencing=args.mutate_fencing,
                   restarts=tuple(("fast", "immediate")[n % 2] for n in range(args.restarts)))
    server = None
    if args.admin_url:
        target = Target(args.admin_url)
    else:
        reason = rig_server.available()
        if reason:
            print(f"cannot start a rig server: {reason}", file=sys.stderr)  # noqa: T201
            return 2
        server = rig_server.create_server()
        target = Target(server.url(), server)
    try:
        results = asyncio.run(run(names, opts, target, out))
    finally:
        if server is not None:
            server.destroy()
    print(f"reports in {out}", file=sys.stderr)  # noqa: T201
    return 1 if any(r.get("violations") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
