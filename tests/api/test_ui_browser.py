"""The UI in a real headless Chromium (Debian's chromium and chromium-driver), driven by Selenium.

Clicks through: sign in, find a failed instance, see its graph with the failed step marked, retry it
through the confirmation, watch it go on and complete live (no reload); bulk-retry a selection
of incidents and read the per-item result; complete a task from the inbox with its generated form.
Screenshots go to $STEPSTONE_UI_SCREENSHOTS when set (docs/images/ holds the ones the docs show),
else to the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stepstone.api import context_on, create_app
from stepstone.api.tokens import create_token
from stepstone.testing import open_engine
from tests.api import workflows
from tests.api.serving import served

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)",
    ),
    # First pass only: the clicks test the pages; their queries run against the second PostgreSQL in
    # tests/api's other tests.
    pytest.mark.first_pass_only,
]
WAIT = 20.0
_DEBUG: list[Any] = []


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver  # noqa: PLC0415 - only when chromium is there
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,1000", "--disable-extensions", "--no-first-run"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.implicitly_wait(0)
    _DEBUG[:] = [driver]
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("STEPSTONE_UI_SCREENSHOTS") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    return where


async def until(check: Callable[[], Any], what: str) -> Any:
    """Poll `check` (run in a thread: Selenium blocks) until it returns something truthy.

    A live page swaps elements as the instance moves, so an element found a moment ago may be gone
    when read: that counts as "not yet", and the next poll finds the new one."""
    from selenium.common.exceptions import StaleElementReferenceException  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while True:
        try:
            found = await asyncio.to_thread(check)
        except StaleElementReferenceException:
            found = None
        if found:
            return found
        if loop.time() >= deadline:
            print(await asyncio.to_thread(lambda: _DEBUG[0].page_source if _DEBUG else ""))  # noqa: T201
        assert loop.time() < deadline, f"the page never showed {what}"
        await asyncio.sleep(0.1)


@pytest.fixture
async def site(database_url: str) -> AsyncIterator[dict[str, Any]]:
    async with open_engine(database_url, workflows.registry, concurrency=2, poll_interval=0.2) as engine:
        ctx = context_on(engine.store, registry=workflows.registry)
        await engine.worker.start()
        try:
            async with served(create_app(ctx)) as base:
                token, _ = await create_token(ctx.management, role="operator", name="browser")
                yield {"engine": engine, "base": base, "token": token, "management": ctx.management}
        finally:
            await engine.worker.stop()
            await ctx.close()


async def sign_in(browser: Any, url: str, token: str) -> None:
    """Open `url` (the sign-in page, or a page that leads there), sign in, wait for a signed-in page."""
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    def submit() -> None:
        browser.get(url)
        browser.find_element(By.ID, "token").send_keys(token)
        browser.find_element(By.CSS_SELECTOR, "main form button[type=submit]").click()

    await asyncio.to_thread(submit)
    await until(lambda: browser.find_elements(By.CSS_SELECTOR, "form.who"), "the signed-in page")


async def _settled(engine: Any, iid: str, status: str) -> None:
    """Until the instance has `status`: read again after each of the worker's commits, which are what move it."""
    events = engine.worker.events
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while True:
        seen = events.commits  # before the read: a commit from here on wakes the wait below
        if (await engine.client.get(iid)).status == status:
            return
        remaining = deadline - loop.time()
        assert remaining > 0, f"{iid} never became {status}"
        with contextlib.suppress(TimeoutError):
            await events.wait_until(lambda seen=seen: events.commits != seen, timeout=remaining)


async def test_find_a_failed_instance_retry_it_and_see_it_complete_live(
    site: dict[str, Any], browser: Any, shots: Path,
) -> None:
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    engine, base = site["engine"], site["base"]
    workflows.FAILING.add("declined-order")
    failed = await engine.client.start("job", {"name": "declined-order"})
    fine = await engine.client.start("job", {"name": "fine-order"})
    await _settled(engine, failed, "FAILED")
    await _settled(engine, fine, "WAITING")

    await sign_in(browser, f"{base}/ui/", site["token"])
    await until(lambda: browser.find_elements(By.CSS_SELECTOR, "table.list tbody tr a.mono"), "the instances")
    await asyncio.to_thread(browser.save_screenshot, str(shots / "ui-instances.png"))

    def open_failed() -> None:
        browser.find_element(By.CSS_SELECTOR, "a.status-failed").click()

    await asyncio.to_thread(open_failed)
    links = await until(lambda: browser.find_elements(By.CSS_SELECTOR, "table.list tbody a.mono"), "failed ones")
    assert [a.text for a in links] == [failed[-8:]]

    def save_view() -> None:
        browser.find_element(By.CSS_SELECTOR, "[data-save-view]").click()
        prompt = browser.switch_to.alert
        prompt.send_keys("failed ones")
        prompt.accept()

    await asyncio.to_thread(save_view)
    saved = await until(lambda: browser.find_elements(By.LINK_TEXT, "failed ones"), "the saved view")
    assert saved[0].get_attribute("href").endswith("/ui/?status=FAILED")
    await asyncio.to_thread(lambda: browser.find_element(By.LINK_TEXT, failed[-8:]).click())
    await until(lambda: browser.find_elements(By.CSS_SELECTOR, "svg.diagram"), "the graph")
    marked = browser.find_elements(By.CSS_SELECTOR, 'svg.diagram g.node.failed[data-step="charge"]')
    assert len(marked) == 1
    assert browser.find_element(By.ID, "status").text == "failed"
    await asyncio.to_thread(browser.save_screenshot, str(shots / "ui-instance-failed.png"))

    workflows.FAILING.discard("declined-order")
    await asyncio.to_thread(lambda: browser.find_element(By.LINK_TEXT, "Retry…").click())
    await until(lambda: "Retry this instance?" in browser.page_source, "the confirmation")
    await asyncio.to_thread(browser.save_screenshot, str(shots / "ui-confirm-retry.png"))
    await asyncio.to_thread(lambda: browser.find_element(By.CSS_SELECTOR, "main form button[type=submit]").click())
    await _settled(engine, failed, "WAITING")
    await until(lambda: browser.find_elements(By.CSS_SELECTOR, 'svg.diagram g.node.current[data-step="approval"]'),
                "the instance waiting for approval")
    browser.execute_script("window.__sameDocument = 'yes'")
    # approved elsewhere (another operator, a program): the open page follows without a reload
    await engine.client.signal(failed, "approve")
    await until(lambda: browser.find_element(By.ID, "status").text == "completed", "the completed status")
    assert browser.execute_script("return window.__sameDocument") == "yes"
    assert browser.find_elements(By.CSS_SELECTOR, 'svg.diagram g.node.visited[data-step="ship"]')
    assert browser.find_elements(By.CSS_SELECTOR, 'svg.diagram g.node.visited[data-step="$end"]')
    assert browser.find_elements(By.CSS_SELECTOR, "svg.diagram path.edge.executed")
    await asyncio.to_thread(browser.save_screenshot, str(shots / "ui-instance-completed.png"))

    browser.set_window_size(390, 900)  # a phone
    await asyncio.to_thread(browser.refresh)
    await until(lambda: browser.find_elements(By.CSS_SELECTOR, "svg.diagram"), "the graph on a phone")
    width = browser.execute_script("return document.documentElement.scrollWidth")
    assert width <= 400, f"the page is {width} px wide on a 390 px screen"
    await asyncio.to_thread(browser.save_screenshot, str(shots / "ui-instance-phone.png"))


async def test_bulk_retry_a_selection_of_incidents_and_read_each_result(
    site: dict[str, Any], browser: Any, shots: Path,
) -> None:
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    engine, base = site["engine"], site["base"]
    workflows.FAILING.update({"one", "two"})
    one = await engine.client.start("job", {"name": "one"})
    two = await engine.client.start("job", {"name": "two"})
    for iid in (one, two):
        await _settled(engine, iid, "FAILED")
    workflows.FAILING.discard("one")  # "two" fails again on its retry

    await sign_in(browser, f"{base}/ui/login", site["token"])
    await asyncio.to_thread(lambda: browser.find_element(By.LINK_TEXT, "Incidents").click())
    boxes = await until(lambda: browser.find_elements(By.CSS_SELECTOR, "input[name=instance]"), "the incidents")
    assert len(boxes) == 2
    for box in boxes:
        await asyncio.to_thread(box.click)
    await asyncio.to_thread(browser.save_screenshot, str(shots / "ui-incidents.png"))
    await asyncio.to_thread(lambda: browser.find_element(By.XPATH, "//button[text()='Retry selected…']").click())
    await until(lambda: "Retry 2 instance(s)?" in browser.page_source, "the count to confirm")
    await asyncio.to_thread(lambda: browser.find_element(By.XPATH, "//button[text()='Retry all']").click())
    heading = await until(lambda: browser.find_elements(By.ID, "res-h"), "the results")
    assert heading[0].text == "Retry results: 2 of 2 retried"
    items = browser.find_elements(By.CSS_SELECTOR, ".results li")
    assert sorted(i.text.split()[0] for i in items) == sorted([one[-8:], two[-8:]])
    await asyncio.to_thread(browser.save_screenshot, str(shots / "ui-bulk-retry.png"))
    await _settled(engine, one, "WAITING")
    await _settled(engine, two, "FAILED")


async def test_complete_a_task_from_the_inbox_with_its_form(site: dict[str, Any], browser: Any, shots: Path) -> None:
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    engine, base = site["engine"], site["base"]
    iid = await engine.client.start("expense", {"employee": "ann", "amount": 75})
    token, _ = await create_token(site["management"], role="task_worker", name="mia")

    await sign_in(browser, f"{base}/ui/login", token)
    await asyncio.to_thread(lambda: browser.find_element(By.LINK_TEXT, "Tasks").click())
    link = await until(lambda: browser.find_elements(By.LINK_TEXT, "Approve ann's expense"), "the task in the inbox")
    await asyncio.to_thread(browser.save_screenshot, str(shots / "ui-tasks.png"))
    await asyncio.to_thread(link[0].click)
    await until(lambda: browser.find_elements(By.CSS_SELECTOR, "form.decision[data-decision=approve]"), "the form")

    def fill(amount: str) -> None:
        form = browser.find_element(By.CSS_SELECTOR, "form.decision[data-decision=approve]")
        form.find_element(By.NAME, "f.comment").clear()
        form.find_element(By.NAME, "f.comment").send_keys("within budget")
        form.find_element(By.NAME, "f.approved_amount").clear()
        form.find_element(By.NAME, "f.approved_amount").send_keys(amount)

    await asyncio.to_thread(fill, "70")
    await asyncio.to_thread(browser.save_screenshot, str(shots / "ui-task-form.png"))
    await asyncio.to_thread(lambda: browser.find_element(
        By.CSS_SELECTOR, "form.decision[data-decision=approve] button[type=submit]").click())
    flash = await until(lambda: browser.find_elements(By.CSS_SELECTOR, "p.flash"), "the completion's flash")
    assert flash[0].text.startswith("completed ") and flash[0].text.endswith("with approve")
    await asyncio.to_thread(browser.save_screenshot, str(shots / "ui-task-completed.png"))
    await _settled(engine, iid, "COMPLETED")
    state = (await engine.client.get(iid)).state
    assert (state["outcome"], state["comment"]) == ("paid by mia", "within budget")
    await asyncio.to_thread(browser.refresh)
    await until(lambda: "No open tasks here." in browser.page_source, "the inbox without the completed task")


async def test_bulk_retry_every_incident_a_filter_matches_and_read_each_result(
    site: dict[str, Any], browser: Any, shots: Path,
) -> None:
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    engine, base = site["engine"], site["base"]
    workflows.FAILING.update({"north-1", "north-2", "south-1"})
    north = [await engine.client.start("job", {"name": n}, scope="north") for n in ("north-1", "north-2")]
    south = await engine.client.start("job", {"name": "south-1"}, scope="south")
    for iid in (*north, south):
        await _settled(engine, iid, "FAILED")
    workflows.FAILING.discard("north-1")  # "north-2" fails again on its retry

    await sign_in(browser, f"{base}/ui/login", site["token"])
    await asyncio.to_thread(lambda: browser.find_element(By.LINK_TEXT, "Incidents").click())

    def narrow() -> None:
        field = browser.find_element(By.CSS_SELECTOR, "form.filters input[name=scope]")
        field.send_keys("north")
        browser.find_element(By.XPATH, "//form[@role='search']//button[text()='Filter']").click()

    await asyncio.to_thread(narrow)
    button = await until(lambda: browser.find_elements(
        By.XPATH, "//button[text()='Retry every failed instance of scope north…']"), "the filtered incidents")
    assert len(browser.find_elements(By.CSS_SELECTOR, "input[name=instance]")) == 2
    await asyncio.to_thread(browser.save_screenshot, str(shots / "ui-incidents-filtered.png"))
    await asyncio.to_thread(button[0].click)
    await until(lambda: "Retry 2 instance(s)?" in browser.page_source, "the honest count to confirm")
    await asyncio.to_thread(lambda: browser.find_element(By.XPATH, "//button[text()='Retry every match']").click())
    heading = await until(lambda: browser.find_elements(By.ID, "res-h"), "the results")
    assert heading[0].text == "Retry results: 2 of 2 retried"
    items = browser.find_elements(By.CSS_SELECTOR, ".results li")
    assert sorted(i.text for i in items) == sorted(f"{iid[-8:]} retried" for iid in north)
    assert {i.get_attribute("data-outcome") for i in items} == {"retried"}
    await asyncio.to_thread(browser.save_screenshot, str(shots / "ui-bulk-retry-filter.png"))
    await _settled(engine, north[0], "WAITING")
    await _settled(engine, north[1], "FAILED")
    assert (await engine.client.get(south)).status == "FAILED"
