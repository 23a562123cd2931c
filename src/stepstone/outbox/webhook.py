"""Webhook publisher (extra ``stepstone[webhook]``): one HTTP POST per event, for systems without a broker.

    https://hooks.example.com/events          every event to one URL
    https://hooks.example.com/events/{type}   routed by event type ({type}, {category}, {key})

A field's value is percent-encoded into the URL: an event keyed ``../admin`` or ``a#b`` goes to
``/events/..%2Fadmin`` or ``/events/a%23b``, never to another path or without its fragment.

The body is the JSON envelope; the headers carry ``Idempotency-Key: <event id>`` (the receiver's dedup
id), the event type, key and instance, and ``traceparent`` / ``tracestate`` when the event has them; a
value no header carries as it is (a key such as ``café``) is left out of them, the envelope has it.
A 2xx answer acknowledges the event; 408, 425, 429 and 5xx are transient; a connection that fails counts
no attempt. An answer that can only mean the configured endpoint is wrong for every event holds the outbox
(no attempt counted, as a broker refusing its setup): a redirect (3xx; no redirect is followed), 401, 403 or
407 (the credentials), and 404, 405 or 410 from a URL with no `{field}` (the same for every event). Any other
status refuses the event for good (dead-lettered until requeued): 400, 413, 422, or a 404 from a URL built
from the event.

The URL's query is the receiver's and goes out as given, so the publisher's own options ride in the
fragment, which no HTTP client sends: ``https://hooks.example.com/events/{type}#timeout=5&concurrency=8``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import httpx

from stepstone.errors import BrokerUnavailable
from stepstone.outbox.publisher import (
    MAX_CONCURRENCY,
    PublishResult,
    Routing,
    body_of,
    publish_in_lanes,
    text_headers_of,
    whole_option,
)
from stepstone.store.database import redact_url
from stepstone.store.outbox import StagedEvent

__all__ = ["WebhookPublisher", "webhook_publisher"]

_TRANSIENT_STATUS = frozenset({408, 425, 429})
_CREDENTIALS_STATUS = frozenset({401, 403, 407})
"""Answers about the request's credentials (the URL's, the publisher's headers), whatever its event."""
_NO_ENDPOINT_STATUS = frozenset({404, 405, 410})
"""Answers about the URL: about the configuration when the URL is the same for every event."""
_OPTIONS = ("timeout", "concurrency")
MAX_TIMEOUT = 3600.0
"""Seconds a POST may wait at most (`timeout`): the relay bounds a whole publish by half its lease anyway."""
_TIMED_OUT: dict[type[httpx.HTTPError], str] = {
    httpx.ConnectTimeout: "no connection", httpx.WriteTimeout: "the event not sent",
    httpx.ReadTimeout: "no answer", httpx.PoolTimeout: "no free connection",
}
"""What each of httpx's timeouts means for a POST, said in the event's last error."""


class WebhookPublisher:
    def __init__(self, url: str, *, concurrency: int = 32, timeout: float = 10.0,
                 headers: dict[str, str] | None = None) -> None:
        self.routing = Routing(url, url_quoted=True)
        self.name = redact_url(url)
        self.concurrency = concurrency
        self.timeout = timeout
        self.client = httpx.AsyncClient(timeout=timeout, headers=headers or {},
                                        limits=httpx.Limits(max_connections=concurrency))

    async def publish(self, batch: Sequence[StagedEvent]) -> list[PublishResult]:
        held: dict[str, PublishResult] = {}  # targets answered "wrong for every event" in this batch: not asked again

        async def send(event: StagedEvent) -> PublishResult:
            headers = {"content-type": "application/json", "idempotency-key": event.event_id,
                       **text_headers_of(event)}
            target = self.routing.target(event)
            if target in held:
                return held[target]
            try:
                answer = await self.client.post(target, content=body_of(event), headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                return PublishResult.transient(self._failure(target, exc), attempted=False)
            except httpx.HTTPError as exc:
                return PublishResult.transient(self._failure(target, exc))
            result = self._answered(target, answer)
            if result.misconfigured:
                held[target] = result
            return result

        results = await publish_in_lanes(batch, send, concurrency=self.concurrency)
        if results and not any(r.attempted or r.misconfigured for r in results):
            raise BrokerUnavailable(results[0].error or f"{self.name} unreachable")
        return results

    def _answered(self, target: str, answer: httpx.Response) -> PublishResult:
        """What a status means: 2xx acknowledged; 408, 425, 429 and 5xx transient; an answer about the
        endpoint whatever the event held (`_wrong_for_every_event`); anything else refused."""
        if answer.is_success:
            return PublishResult.OK
        reason = f"{redact_url(target)}: HTTP {answer.status_code} {answer.reason_phrase}"
        if answer.status_code in _TRANSIENT_STATUS or answer.status_code >= 500:
            return PublishResult.transient(reason)
        wrong = self._wrong_for_every_event(answer)
        return PublishResult.refused(reason) if wrong is None else PublishResult.held(f"{reason}: {wrong}")

    def _wrong_for_every_event(self, answer: httpx.Response) -> str | None:
        """Why an answer can only mean the configured endpoint is wrong whatever the event, or None when it
        may be about the event (400, 413, 422, a 404 from a URL built from the event): refused then."""
        status = answer.status_code
        if 300 <= status < 400:
            where = answer.headers.get("location")
            to = f" to {redact_url(where)}" if where else ""
            return (f"the receiver redirects{to} and the publisher follows no redirect: set the broker URL to the "
                    "address it names")
        if status in _CREDENTIALS_STATUS:
            return ("the receiver refuses the request whatever the event: check the credentials of the broker URL "
                    "and the publisher's headers")
        if status in _NO_ENDPOINT_STATUS and self.routing.fixed:
            return "the URL is the same for every event, so no event can be delivered there: check the broker URL"
        return None

    def _failure(self, target: str, exc: httpx.HTTPError) -> str:
        """The event's own URL (not the template) and what failed: a timeout says what it waited for."""
        said = _TIMED_OUT.get(type(exc))
        what = f"{said} within {self.timeout:g} s" if said else str(exc)
        return f"{redact_url(target)}: {type(exc).__name__}" + (f": {what}" if what else "")

    async def close(self) -> None:
        await self.client.aclose()


def webhook_publisher(url: str, **options: Any) -> WebhookPublisher:
    """Entry point for ``http://`` and ``https://``: the options from the URL's fragment (`options` given
    by a caller win), the URL without it."""
    parts = urlsplit(url)
    ours = {**_fragment_options(parts.fragment), **{name: str(value) for name, value in options.items()}}
    return WebhookPublisher(urlunsplit(parts._replace(fragment="")), timeout=_timeout(ours.get("timeout", "10")),
                            concurrency=whole_option(ours, "concurrency", 32, 1, MAX_CONCURRENCY))


def _fragment_options(fragment: str) -> dict[str, str]:
    """`timeout` and `concurrency` from the fragment; anything else in it is refused (ValueError), as an
    unknown query option of the other publishers is."""
    found: dict[str, str] = {}
    for name, value in parse_qsl(fragment, keep_blank_values=True):
        if name not in _OPTIONS:
            raise ValueError(f"unknown option {name!r} in the fragment; it takes {', '.join(_OPTIONS)}")
        if not value:
            raise ValueError(f"{name} must not be empty")
        found[name] = value
    return found


def _timeout(text: str) -> float:
    """Seconds above 0 and at most MAX_TIMEOUT; else ValueError (a malformed broker URL)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT:  # NaN fails both
        raise ValueError(f"timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT:g}, got {text!r}")
    return value
