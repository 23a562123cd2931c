"""A fresh database for one run of a standalone perf script (`python tests/perf/<script>.py`).

The scripts import this as a sibling module (their own directory is first on `sys.path` when run), and
it uses only asyncpg, so a script still measures whichever stepstone is importable: the working tree's,
or another tree's `src` put first on PYTHONPATH for an A/B pair.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg


@asynccontextmanager
async def scratch_database(admin_url: str, prefix: str) -> AsyncIterator[str]:
    """Create `<prefix>_<random>` on the server of `admin_url`, yield its URL, drop it after (FORCE: the
    run's pools may still hold connections when it ends, or fails)."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield admin_url.rsplit("/", 1)[0] + f"/{name}"
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()
