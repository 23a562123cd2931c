"""``stepstone demo saga``: the booking saga's payment fails for good; hotel, then flight, are compensated."""

from __future__ import annotations

import re

from click.testing import CliRunner

from stepstone.cli import cli


def test_demo_saga_compensates_in_reverse_order(database_url: str) -> None:
    result = CliRunner().invoke(cli, ["demo", "saga", "--database-url", database_url], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    tag = re.match(r"\[booking t-[0-9a-f]+\]", lines[1])
    assert tag is not None, lines[1]
    assert [line.removeprefix(tag.group(0) + " ") for line in lines[2:-1]] == [
        "step reserve_flight completed",
        "step reserve_hotel completed",
        "step charge_card failed: CardDeclined: card of ada declined",
        "compensating the completed steps in reverse order",
        "compensated reserve_hotel (attempt 1)",
        "compensated reserve_flight (attempt 1)",
    ]
    assert lines[-1] == "saga: COMPENSATED after charge_card failed; compensated reserve_hotel, reserve_flight"
