"""Getting staged events out: the relay service and the publisher port (brokers are extras)."""

from stepstone.outbox.publisher import (
    InMemoryBroker,
    InMemoryPublisher,
    Outcome,
    Publisher,
    PublishResult,
    Routing,
    open_publisher,
)
from stepstone.outbox.relay import Relay, RelayConfig, RelayEvents

__all__ = [
    "InMemoryBroker",
    "InMemoryPublisher",
    "Outcome",
    "PublishResult",
    "Publisher",
    "Relay",
    "RelayConfig",
    "RelayEvents",
    "Routing",
    "open_publisher",
]
