"""Mistakes in a workflow's definition are a DefinitionError when it is defined, and a state with a
key JSON spells as text (an int) is stored as JSON stores it: neither reaches stepstone's own code as
a crash of the worker (which repeated the step on every lease expiry until it was dead-lettered)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from stepstone import Registry, Retry, StepContext, Workflow
from stepstone.errors import DefinitionError
from stepstone.testing import open_engine


@pytest.mark.parametrize(("make", "said"), [
    (lambda: Retry(non_retryable=[KeyError, "ValueError"]), "takes exception classes"),  # type: ignore[list-item]
    (lambda: Retry(max_attempts="3"), "whole number"),  # type: ignore[arg-type]
    (lambda: Retry(multiplier="2"), "takes a number"),  # type: ignore[arg-type]
    (lambda: Workflow("w", deadline="soon"), "a duration is seconds"),  # type: ignore[arg-type]
    (lambda: Workflow("w", deadline=-5), "must not be negative"),  # every start refused it
    (lambda: Workflow("w", state=dict), "state must be a pydantic model class"),  # found at the first start
])
def test_a_misused_argument_is_a_definition_error(make: Any, said: str) -> None:
    with pytest.raises(DefinitionError, match=said):
        make()


def test_retry_takes_a_retry_and_its_non_retryable_a_class_or_several() -> None:
    wf = Workflow("misuse_retry")
    with pytest.raises(DefinitionError, match=r"retry=\.\.\. takes a Retry"):
        wf.step(start=True, retry={"max_attempts": 3})(lambda _ctx, _state: None)  # type: ignore[arg-type]
    assert Retry(non_retryable=KeyError).non_retryable == (KeyError,)  # type: ignore[arg-type]
    assert Retry(non_retryable=[KeyError, ValueError]).non_retryable == (KeyError, ValueError)  # type: ignore[arg-type]
    assert Retry(backoff=timedelta(seconds=2)).policy().initial_backoff == 2.0


wary = Workflow("misuse_wary")


@wary.step(start=True, retry=Retry(max_attempts=3, backoff=0, non_retryable=[KeyError]))  # type: ignore[arg-type]
def wary_step(ctx: StepContext, state: dict[str, Any]) -> None:
    raise KeyError("never retried")


keyed = Workflow("misuse_keyed")


@keyed.step(start=True, retry=Retry(max_attempts=1))
def keyed_step(ctx: StepContext, state: dict[str, Any]) -> None:
    state[1] = "one"  # JSON spells keys as text


async def test_a_list_of_non_retryable_errors_and_an_int_key_do_not_crash_the_worker(database_url: str) -> None:
    async with open_engine(database_url, Registry(wary, keyed)) as engine:
        never = await engine.client.start(wary, {})
        key = await engine.client.start(keyed, {})
        await engine.run_until_idle()
        failed = await engine.client.get(never)
        assert (failed.status, failed.error["type"]) == ("FAILED", "KeyError")
        await engine.assert_step_ran(never, "wary_step", times=0)  # one attempt, not retried: no completion
        info = await engine.client.get(key)  # stored as JSON stores it: the key as text, as json.dumps does
        assert (info.status, info.state) == ("COMPLETED", {"1": "one"}), info
