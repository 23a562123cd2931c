"""Interleaved A/B of the throughput harness: a git revision against the working tree, in pairs.

Not a test (pytest does not collect it). Every hot-path change goes in with at least three interleaved
pairs on the same server (issue 17); this runs them the one way: a temporary worktree of --before, then
for each pair `tests/perf/ab_throughput.py` on that tree (its `src` first on PYTHONPATH) and on this one,
alternating, and a summary: the means of workflows/s and of the harness's CPU a step commit (this
process's, the bench's "engine CPU"), and in how many pairs the working tree won each.

    python tests/perf/ab_pairs.py --before 4058963 --pairs 4 --total 6000
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "perf" / "ab_throughput.py"


def one_run(label: str, src: Path, total: int, admin_url: str, extra: list[str]) -> tuple[float, float]:
    """(workflows/s, this process's CPU µs a step commit) of one run of the harness."""
    env = {**os.environ, "PYTHONPATH": str(src)}  # ahead of the editable install
    out = subprocess.run(
        [sys.executable, str(HARNESS), label, "--total", str(total), "--admin-url", admin_url, *extra],
        capture_output=True, text=True, check=True, env=env,
    ).stdout
    found = re.search(rf"^{label} (\d+) workflows/s$", out, re.MULTILINE)
    cpu = re.search(r"^  CPU (\d+) us a step commit", out, re.MULTILINE)
    if found is None or cpu is None:
        raise SystemExit(f"no result in the {label} run's output:\n{out}")
    return float(found.group(1)), float(cpu.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision to compare the working tree against")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--total", type=int, default=6000, help="workflows measured in each run")
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--waiting", action="store_true",
                        help="the harness's --waiting: workflows that enter a timed wait")
    args = parser.parse_args()
    extra = ["--waiting"] if args.waiting else []
    with tempfile.TemporaryDirectory(prefix="stepstone-ab-") as scratch:
        before_tree = Path(scratch) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(before_tree), args.before],
                       check=True)
        try:
            results: list[tuple[float, float]] = []
            cpus: list[tuple[float, float]] = []
            for n in range(1, args.pairs + 1):
                before, before_cpu = one_run("before", before_tree / "src", args.total, args.admin_url, extra)
                after, after_cpu = one_run("after", ROOT / "src", args.total, args.admin_url, extra)
                results.append((before, after))
                cpus.append((before_cpu, after_cpu))
                print(f"pair {n}: before {before:.0f}, after {after:.0f} workflows/s; CPU {before_cpu:.0f}, "  # noqa: T201
                      f"{after_cpu:.0f} us a step commit", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before_tree)], check=True)
    befores, afters = [b for b, _ in results], [a for _, a in results]
    won = sum(a > b for b, a in results)
    change = statistics.mean(afters) / statistics.mean(befores) - 1
    print(f"mean before {statistics.mean(befores):.0f}, after {statistics.mean(afters):.0f} workflows/s "  # noqa: T201
          f"({change:+.0%}); the working tree was faster in {won} of {len(results)} pairs")
    cheaper = sum(a < b for b, a in cpus)
    print(f"mean CPU before {statistics.mean(b for b, _ in cpus):.0f}, after {statistics.mean(a for _, a in cpus):.0f} "  # noqa: T201
          f"us a step commit; the working tree used less in {cheaper} of {len(cpus)} pairs")


if __name__ == "__main__":
    main()
