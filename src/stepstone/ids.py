"""Instance ids: UUID version 7 (RFC 9562), time-ordered.

48 bits of Unix milliseconds, then 74 random bits (with the version and variant fields). Every index
of an instance's rows leads with its id (instances, positions, commands, history), so random ids put
each new instance on a random leaf page of five indexes that outgrow memory as waiting instances pile
up; time-ordered ids keep new rows on the indexes' right edges (docs/performance-history.md, "Scale, round
2"). The random bits keep ids unguessable; the creation time can be read from an id.
"""

from __future__ import annotations

import os
import time
import uuid

__all__ = ["new_instance_id", "short_id"]


def new_instance_id() -> str:
    """A fresh UUIDv7, as text."""
    value = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    value = value & ~(0xF << 76) | 0x7 << 76  # version 7
    value = value & ~(0x3 << 62) | 0x2 << 62  # variant RFC 9562
    return str(uuid.UUID(int=value))


def short_id(instance_id: str) -> str:
    """The eight characters that tell instances apart at a glance: the id's last ones, which are random
    (its first ones are the start time, the same for every instance started within a minute)."""
    return str(instance_id)[-8:]
