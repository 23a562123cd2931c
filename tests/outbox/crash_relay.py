"""A relay process that publishes one batch and then hangs before recording it: the test kills it there.

    python -m tests.outbox.crash_relay DATABASE_URL BROKER_URL BATCH_SIZE

After the broker acknowledged the batch it prints one JSON line (the event ids published) and waits
for ever, between publish and mark, until the test sends SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence

from stepstone.outbox.publisher import Publisher, PublishResult, open_publisher
from stepstone.outbox.relay import Relay, RelayConfig
from stepstone.store.outbox import PostgresOutbox, StagedEvent
from stepstone.store.postgres import PostgresStore
from tests.outbox.conftest import first_claim


class HangAfterPublish:
    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.name = inner.name

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        results = await self.inner.publish(batch)
        sent = [e.event_id for e, r in zip(batch, results, strict=True) if r.error is None]
        print(json.dumps(sent), flush=True)  # noqa: T201 - the test reads this line
        await asyncio.Event().wait()
        return results

    async def close(self) -> None:
        await self.inner.close()


async def main(database_url: str, broker_url: str, batch_size: int) -> None:
    store = await PostgresStore.open(database_url, max_size=2)
    relay = Relay(PostgresOutbox(store), HangAfterPublish(open_publisher(broker_url)),
                  RelayConfig(batch_size=batch_size, lease_seconds=600, relay_id="doomed"))
    await first_claim(relay)  # a claim can come back empty while a foreign transaction holds the horizon


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
