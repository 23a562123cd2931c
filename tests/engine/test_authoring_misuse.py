"""Mistakes in a workflow's definition are a DefinitionError when it is defined, and a state with a
key JSON spells as text (an int) is stored as JSON stores it: neither reaches stepstone's own code as
a crash of the worker (which repeated the step on every lease expiry until it was dead-lettered)."""

from __future__ import annotations

import functools
from datetime import datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from stepstone import Registry, Retry, StepContext, Workflow
from stepstone.errors import DefinitionError
from stepstone.scheduling.schedule import Schedule, ScheduleError
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


def _noop(ctx: StepContext, state: Any) -> None:
    return None


def _plan_of(declare: Any) -> Any:
    """A one-off workflow with what `declare` adds, built (building checks the plan)."""
    wf: Workflow[Any] = Workflow("misuse_shape")
    declare(wf)
    return wf.plan


def _need_more_than_branches(wf: Workflow[Any]) -> None:
    wf.fork("f", branches={"a": "s", "b": "s"}, start=True)
    wf.step(name="s", next="j")(_noop)
    wf.join("j", fork="f", next="e", need=5)
    wf.step(name="e")(_noop)


@pytest.mark.parametrize(("declare", "said"), [
    (_need_more_than_branches, "join step 'j' needs 5 branches; fork 'f' has 2"),
    (lambda wf: wf.join("j", fork="f", next="e", need=0), "a count of 1 or more, got 0"),  # it meant all
    (lambda wf: wf.step(name="", start=True)(_noop), "invalid step name ''"),  # was: the handler's name
    (lambda wf: wf.step(name="x", start=True)(5), "the handler must be a function, got 5"),
    (lambda wf: wf.step(name="x", start=True, next=5)(_noop), "next must name a step or a list of steps"),
    (lambda wf: wf.timer("t", delay=5, next=["a"], start=True), r"next must name steps, got \['a'\]"),
    (lambda wf: wf.wait("w", signals=["go"], start=True), r"signals must map names to steps, got \['go'\]"),
    (lambda wf: wf.fork("f", map_over="xs", branch="s", max_items="10", start=True),
     "max_items must be a whole number, got '10'"),
])
def test_a_misshapen_step_is_a_definition_error(declare: Any, said: str) -> None:
    # Each was accepted (an empty name, a list of signals read as {"g": "o"}) or failed with Python's own
    # TypeError ("unhashable type: 'list'", "'<' not supported between 'str' and 'int'").
    with pytest.raises(DefinitionError, match=said):
        _plan_of(declare)


def _three(_ctx: StepContext, _state: Any, _extra: Any) -> None:
    return None


class _Steps:
    def bound(self, _ctx: StepContext, _state: Any) -> None:
        return None


class _At(BaseModel):
    at: datetime | None = None


@pytest.mark.parametrize(("declare", "said"), [
    (lambda wf: wf.step(name="a", start=True)(lambda _s: None),
     r"step 'a': the handler .*<lambda>\(_s\) cannot be called with \(ctx, state\): too many positional arguments"),
    (lambda wf: wf.step(name="a", start=True)(_three),
     r"step 'a': the handler _three\(_ctx, _state, _extra\) cannot be called with \(ctx, state\): .* '_extra'"),
    (lambda wf: wf.step(name="a", start=True)(lambda _c, _s, *, _key: None), "missing a required argument: '_key'"),
    (lambda wf: wf.step(name="a", start=True)(functools.partial(_three, 1, 2)), "too many positional arguments"),
    (lambda wf: wf.step(start=True)(functools.partial(_three, _extra=1)), r"needs a name: it has no __name__"),
    (lambda wf: wf.child(workflow="c", next="e", name="a", start=True)(lambda _s: None),
     r"step 'a': the handler .*\(_s\) cannot be called"),
    (lambda wf: (wf.step(name="a", start=True)(_noop), wf.compensation("a")(_noop)),
     r"the compensation of step 'a': the handler _noop\(ctx, state\) cannot be called with \(ctx, state, recorded\)"),
])
def test_a_handler_that_cannot_take_ctx_and_state_is_a_definition_error(declare: Any, said: str) -> None:
    # Each was accepted, and its first run failed with Python's TypeError, retried as if transient.
    wf: Workflow[Any] = Workflow("misuse_handler")
    with pytest.raises(DefinitionError, match=said):
        declare(wf)


@pytest.mark.parametrize("handler", [
    lambda _c, _s, _extra=1: None, lambda *_args: None, lambda _c, *_rest, **_kw: None,
    functools.partial(_three, _extra=1), _Steps().bound,
])
def test_a_handler_that_can_take_ctx_and_state_is_accepted(handler: Any) -> None:
    wf: Workflow[Any] = Workflow("misuse_handler")
    wf.step(name="a", next="b", start=True)(handler)
    wf.step(name="b")(_noop)
    wf.compensation("a")(lambda _c, _s, _recorded, _more=None: None)
    assert list(wf.plan.steps) == ["a", "b"]


def test_a_timer_until_a_field_the_state_model_lacks_is_a_definition_error() -> None:
    wf: Workflow[_At] = Workflow("misuse_until", state=_At)
    with pytest.raises(DefinitionError, match="timer 't': until names state field 'when', which _At lacks; "
                                              "its fields: at"):
        wf.timer("t", until="when", next="e", start=True)
    wf.timer("t", until="at", next="e", start=True)
    untyped: Workflow[Any] = Workflow("misuse_until_dict")
    untyped.timer("t", until="when", next="e", start=True)  # a dict state: nothing to check against


def test_a_workflow_id_that_is_not_text_is_a_definition_error() -> None:
    with pytest.raises(DefinitionError, match="invalid definition id 5"):
        Workflow(5).plan  # type: ignore[arg-type]  # noqa: B018 - building the plan checks it


def test_a_schedule_interval_given_as_text_is_refused() -> None:
    with pytest.raises(ScheduleError, match="every takes a timedelta or a number of seconds, got '5'"):
        Schedule("poll", "w", every="5").spec()  # type: ignore[arg-type]
    assert Schedule("poll", "w", every=5).spec().every_seconds == 5.0


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


def test_a_backoff_past_max_backoff_is_said_when_the_step_is_defined(caplog: pytest.LogCaptureFixture) -> None:
    """Retry(backoff=600) waits 60 s (max_backoff's default caps every wait): documented, kept, and now
    said once, in a warning, when the step is defined; the workflow is defined as before."""
    wf = Workflow("patient_retry")
    with caplog.at_level("WARNING", logger="stepstone.authoring"):
        wf.step(name="a", start=True, next="b", retry=Retry(backoff=600))(lambda _ctx, _state: None)
        wf.step(name="b", next=None, retry=Retry(backoff=600, max_backoff=600))(lambda _ctx, _state: None)
    said = [r.getMessage() for r in caplog.records if r.name == "stepstone.authoring"]
    assert said == [("Retry(backoff=600 s) waits at most max_backoff=60 s before each retry: give max_backoff= "
                     "to wait longer")]
    assert wf.plan.steps["a"].retry.backoff(1) == 60.0  # the plan (and its hash) as before
