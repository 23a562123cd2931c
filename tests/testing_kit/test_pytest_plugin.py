"""The pytest plugin, as a user's project sees it: installed through the pytest11 entry point, an
`engine` fixture on a database of its own, time skipping and history assertions."""

from __future__ import annotations

from importlib import metadata

import pytest

from tests._pg import PgServer
from tests.testing_kit import user_project

pytest_plugins = ("pytester",)

# Plugins this suite's environment installs for its own tests, which a user's project does not load: each
# run below starts a pytest of its own, and these were 1.6 of the 2.3 s of CPU of its start-up
# (schemathesis with hypothesis and graphql). The stepstone and asyncio plugins still load as a user's do,
# through their pytest11 entry points.
_NOT_THE_USERS = ("schemathesis", "hypothesispytest", "anyio", "xdist", "xdist.looponfail")


def run_users_pytest(pytester: pytest.Pytester, pg_server: PgServer) -> pytest.RunResult:
    """pytest in a process of its own, on the user's project `pytester` holds, against the test server."""
    unloaded = [arg for name in _NOT_THE_USERS for arg in ("-p", f"no:{name}")]
    return pytester.runpytest_subprocess("--stepstone-database-url", pg_server.admin_url, "-p", "no:cacheprovider",
                                         *unloaded)


def test_the_plugin_is_registered_through_pytest11() -> None:
    points = {ep.name: ep.value for ep in metadata.entry_points(group="pytest11")}
    assert points.get("stepstone") == "stepstone.testing.plugin"


def test_a_users_order_tests_pass_with_the_plugin(pytester: pytest.Pytester, pg_server: PgServer) -> None:
    pytester.makeconftest(user_project.CONFTEST)
    pytester.makepyfile(test_orders=user_project.TEST_ORDERS)
    pytester.makeini(user_project.PYTEST_INI)
    result = run_users_pytest(pytester, pg_server)
    result.assert_outcomes(passed=2)


def test_a_failed_history_assertion_says_what_ran(pytester: pytest.Pytester, pg_server: PgServer) -> None:
    pytester.makeconftest(user_project.CONFTEST)
    pytester.makepyfile(test_wrong='''
from stepstone.examples.orders import orders

async def test_wrong(engine):
    iid = await engine.client.start(orders, {"order_id": "o", "customer": "c", "lines": [{"sku": "b", "quantity": 1}]})
    await engine.run_until_idle()
    await engine.assert_step_ran(iid, "reserve_stock", times=2)
''')
    pytester.makeini(user_project.PYTEST_INI)
    result = run_users_pytest(pytester, pg_server)
    result.assert_outcomes(failed=1)
    said = ("*step 'reserve_stock' of instance * ran 1 time(s), expected 2; "
            "the steps that ran (times): reserve_stock (1)*")
    result.stdout.fnmatch_lines([said])


def test_without_a_registry_the_fixture_says_how_to_give_one(pytester: pytest.Pytester, pg_server: PgServer) -> None:
    pytester.makepyfile(test_none="async def test_none(engine):\n    pass\n")
    pytester.makeini(user_project.PYTEST_INI)
    result = run_users_pytest(pytester, pg_server)
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*define `@pytest.fixture def stepstone_registry()*"])


def test_the_authoring_guides_testing_snippet_runs_with_the_plugin(pytester: pytest.Pytester,
                                                                   pg_server: PgServer) -> None:
    """docs/authoring.md's "Testing a workflow", copied into a user's project: its fixtures are the plugin's
    (it asked for `database_url`, which only stepstone's own tests/conftest.py provides)."""
    from pathlib import Path  # noqa: PLC0415

    guide = (Path(__file__).resolve().parents[2] / "docs" / "authoring.md").read_text(encoding="utf-8")
    snippet = guide.split("## Testing a workflow", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    pytester.makepyfile(test_snippet=snippet)
    pytester.makeini(user_project.PYTEST_INI)
    result = run_users_pytest(pytester, pg_server)
    result.assert_outcomes(passed=1)


def test_docs_testing_shows_the_tests_run_here() -> None:
    from pathlib import Path  # noqa: PLC0415

    page = (Path(__file__).resolve().parents[2] / "docs" / "testing.md").read_text()
    assert user_project.TEST_ORDERS.strip() in page
    assert user_project.CONFTEST.strip() in page
