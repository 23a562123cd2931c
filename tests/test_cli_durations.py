"""Every option of the CLI that takes a length of time reads it with one parser: a bare number is seconds,
and 90s, 15m, 2h, 30d, 1w are taken too, each refusal worded the same (docs/cli.md says it once)."""

from __future__ import annotations

from collections.abc import Iterator

import click
import pytest

from stepstone.cli import cli
from stepstone.cli.common import Duration

TIME_OPTIONS = {
    "start --deadline", "schedules create --every", "limits set --min-interval", "stuck --older-than",
    "retention set WINDOW", "retention set --purge-after", "messages publish --ttl", "definitions migrate --patience",
    "worker --lease-seconds", "worker --poll-interval", "worker --drain-timeout", "worker --heartbeat-seconds",
    "worker --retention-every",
}


def _params(command: click.Command, path: str = "") -> Iterator[tuple[str, click.Parameter]]:
    if isinstance(command, click.Group):  # its commands are loaded when asked for
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            assert sub is not None
            yield from _params(sub, f"{path} {name}".strip())
        return
    for param in command.params:
        name = param.opts[0] if isinstance(param, click.Option) else (param.metavar or param.name or "").split("|")[0]
        yield f"{path} {name}", param


def _time_params() -> dict[str, click.Parameter]:
    return {name: param for name, param in _params(cli) if isinstance(param.type, Duration)}


def test_every_option_that_takes_a_length_of_time_takes_the_duration_type() -> None:
    """`stuck --older-than 60` was refused ("not a duration like 90s ..."), `messages publish --ttl 5m` was
    "not a valid float range", while --deadline and --every took both. Only --within-minutes, whose name says
    its unit, still takes a plain number."""
    assert set(_time_params()) == TIME_OPTIONS
    numbers = {name for name, param in _params(cli) if isinstance(param.type, click.FloatRange)}
    assert numbers == {"definitions stranded --within-minutes"}


@pytest.mark.parametrize("name", sorted(TIME_OPTIONS))
def test_each_takes_seconds_and_units_and_refuses_in_the_same_words(name: str) -> None:
    param = _time_params()[name]
    low = param.type.low  # type: ignore[attr-defined]
    for given, seconds in (("90", 90.0), ("90s", 90.0), ("1.5m", 90.0), ("2h", 7200.0), ("2d", 172_800.0)):
        assert param.type.convert(given, param, None) == seconds, given
    assert param.type.convert("1w", param, None) == 604_800.0
    for given, words in (("90x", "'90x' is not a duration: give seconds (90) or 90s, 15m, 2h, 30d, 1w"),
                         ("-5", "'-5' is not a duration: give seconds (90) or 90s, 15m, 2h, 30d, 1w"),
                         ("nan", "'nan' is not a duration: give seconds (90) or 90s, 15m, 2h, 30d, 1w"),
                         ("99999999w", "'99999999w' is longer than a thousand years")):
        with pytest.raises(click.BadParameter) as refused:
            param.type.convert(given, param, None)
        assert refused.value.message == words
    if low > 0:
        with pytest.raises(click.BadParameter, match=r"'0' is too short: at least \d"):
            param.type.convert("0", param, None)
