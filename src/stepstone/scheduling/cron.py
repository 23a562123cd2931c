"""Five-field cron expressions (minute hour day-of-month month day-of-week), evaluated in a time zone.

    Cron.parse("*/15 9-17 * * mon-fri").next_after(moment, ZoneInfo("Europe/Paris"))

Fields take `*`, numbers, ranges `a-b`, steps `*/n` and `a-b/n`, lists `a,b`, month and weekday names
(`jan`, `mon`), weekday 7 as Sunday, and the usual macros (`@hourly`, `@daily`, `@weekly`, `@monthly`,
`@yearly`). As in classic cron, when both day fields are restricted a day matches either of them.
Ticks are wall-clock times of the zone: a time a DST change skips does not fire that day, and a time
it repeats fires once (at its first occurrence).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, tzinfo

__all__ = ["Cron", "CronError"]

_MACROS = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *",
}
_MONTHS = {m: n for n, m in enumerate(
    ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), start=1)}
_DAYS = {d: n for n, d in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}
_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("minute", 0, 59, {}), ("hour", 0, 23, {}), ("day of month", 1, 31, {}), ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS))
_SEARCH_DAYS = 366 * 8  # covers every valid expression (29 Feb recurs within 8 years)
_SOME_MOMENT = datetime(2000, 1, 1, tzinfo=UTC)


class CronError(ValueError):
    """A cron expression that cannot be parsed; the message names the field."""


@dataclass(frozen=True)
class Cron:
    expression: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool  # day of month is '*'
    any_weekday: bool  # day of week is '*'

    @classmethod
    def parse(cls, expression: str) -> Cron:
        text = _MACROS.get(expression.strip().lower(), expression)
        parts = text.split()
        if len(parts) != 5:
            raise CronError(f"cron expression {expression!r}: expected 5 fields (minute hour day month weekday), "
                            f"got {len(parts)}")
        sets = [_field(part, *spec, expression) for part, spec in zip(parts, _FIELDS, strict=True)]
        weekdays = frozenset(d % 7 for d in sets[4])
        cron = cls(expression, sets[0], sets[1], sets[2], sets[3], weekdays, parts[2] == "*", parts[4] == "*")
        # A day that no month has (31 February) is refused when the schedule is made, not at its first tick.
        cron.next_after(_SOME_MOMENT)
        return cron

    def _day_matches(self, day: date) -> bool:
        if day.month not in self.months:
            return False
        in_month = day.day in self.days
        in_week = (day.isoweekday() % 7) in self.weekdays
        if self.any_day and self.any_weekday:
            return True
        if self.any_day:
            return in_week
        if self.any_weekday:
            return in_month
        return in_month or in_week

    def next_after(self, moment: datetime, zone: tzinfo = UTC) -> datetime:
        """The first tick strictly after `moment` (an aware datetime), as an aware UTC datetime."""
        if moment.tzinfo is None:
            raise ValueError("next_after needs an aware datetime")
        local = moment.astimezone(zone)
        day = local.date()
        for _ in range(_SEARCH_DAYS):
            if self._day_matches(day):
                for hour in sorted(self.hours):
                    for minute in sorted(self.minutes):
                        tick = _wall(day, hour, minute, zone)
                        if tick is not None and tick > moment:
                            return tick
            day += timedelta(days=1)
        raise CronError(f"cron expression {self.expression!r} never fires")


def _wall(day: date, hour: int, minute: int, zone: tzinfo) -> datetime | None:
    """The UTC instant of a wall-clock time in `zone`, or None when the zone skips that time."""
    naive = datetime(day.year, day.month, day.day, hour, minute)  # noqa: DTZ001 - localized just below
    aware = naive.replace(tzinfo=zone, fold=0)
    utc = aware.astimezone(UTC)
    if utc.astimezone(zone).replace(tzinfo=None) != naive:
        return None  # inside a DST gap
    return utc


def _field(part: str, name: str, low: int, high: int, names: dict[str, int], expression: str) -> frozenset[int]:
    values: set[int] = set()
    for item in part.lower().split(","):
        body, _, step_text = item.partition("/")
        try:
            step = _step(step_text)
            if body == "*":
                start, end = low, high
            elif "-" in body:
                a, b = body.split("-", 1)
                start, end = _value(a, names), _value(b, names)
            else:
                start = _value(body, names)
                end = high if step_text else start
        except ValueError:
            raise CronError(f"cron expression {expression!r}: bad {name} field {part!r}") from None
        if not (low <= start <= high and low <= end <= high and start <= end):
            raise CronError(f"cron expression {expression!r}: {name} field {part!r} is outside {low}-{high}")
        values.update(range(start, end + 1, step))
    return frozenset(values)


def _value(text: str, names: dict[str, int]) -> int:
    if text in names:
        return names[text]
    if not text.isdigit():
        raise ValueError(text)
    return int(text)


def _step(text: str) -> int:
    if not text:
        return 1
    step = _value(text, {})
    if step < 1:
        raise ValueError(text)
    return step
