"""The query parameters of every API route are checked (the routes' dependency): an unknown one and a
repeat of one that takes one value are refused.

An unknown parameter was ignored: ``GET /instances?stauts=FAILED`` (a typo) listed every instance, as if
no filter had been given. It is refused with 422 InvalidInput naming it and the parameters the route
takes (``loc`` ``["query", name]``).

Starlette keeps every value of a repeated query parameter, and FastAPI binds a parameter that is not a
list to the LAST of them: ``?workflow=a&workflow=b`` listed only b's instances, and
``?status=FAILED&status=COMPENSATION_FAILED`` (before `status` became a list) only the second status,
silently. A list parameter (``status`` of the instance list, ``state`` of an instance's commands) takes
every value; any other given more than once is refused with 422 InvalidInput naming it, as any other
invalid query parameter is (``loc`` ``["query", name]``).

`query_refusals` is the check itself, which the UI's pages and forms make too (`ui.render.query_of`).
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator
from typing import Annotated, Any, Union, get_args, get_origin

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from stepstone.api.auth import Principal
from stepstone.api.context import principal, writer

__all__ = ["checked_query", "query_refusals"]

_MANY = (list, tuple, set, frozenset)


def _takes_many(annotation: Any) -> bool:
    origin = get_origin(annotation)
    if origin in _MANY:
        return True
    if origin is Annotated:
        return _takes_many(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:  # list[...] | None
        return any(_takes_many(a) for a in get_args(annotation))
    return False


def query_refusals(given: Iterable[str], takes: Collection[str], single: Collection[str], *, of: str,
                   also: Collection[str] = ()) -> list[dict[str, Any]]:
    """What is wrong with a query whose parameter names (one per value) are `given`, of a route or page
    (`of`) that takes `takes` (and `also`, left out of the list the refusal shows), of which `single` take one
    value: each unknown parameter, then each repeat of a one-valued one (errors as FastAPI's validation)."""
    counted = Counter(given)
    listed = ", ".join(sorted(takes)) or "none"
    errors: list[dict[str, Any]] = [
        {"loc": ("query", name), "type": "unknown", "msg": f"not a parameter of this {of} (it takes: {listed})"}
        for name in counted if name not in takes and name not in also]
    errors += [{"loc": ("query", name), "type": "repeated", "msg": f"given {n} times; this parameter takes one value"}
               for name, n in counted.items() if n > 1 and name in single]
    return errors


def _dependants(dependant: Dependant) -> Iterator[Dependant]:
    """The route's dependant and its dependencies' (the inbox's filters are one), depth first."""
    yield dependant
    for dependency in dependant.dependencies:
        yield from _dependants(dependency)


class _Declared:
    """The query parameters a route takes: all of them, and those that take one value."""

    __slots__ = ("names", "single")

    def __init__(self, route: APIRoute) -> None:
        fields = [f for d in _dependants(route.dependant) for f in d.query_params]
        self.names = frozenset(f.alias for f in fields)
        self.single = frozenset(f.alias for f in fields if not _takes_many(f.field_info.annotation))


def _authentication(route: APIRoute) -> Callable[[Request], Awaitable[Principal]] | None:
    """The route's `principal` (or `writer`) dependency, if it takes one."""
    calls = [d.call for d in _dependants(route.dependant)]
    return next((c for c in (writer, principal) if c in calls), None)


async def _checked_query(request: Request) -> None:
    route = request.scope.get("route")
    if not request.query_params or not isinstance(route, APIRoute):
        return  # no parameter given: nothing to look up
    declared = _Declared(route)
    errors = query_refusals((name for name, _ in request.query_params.multi_items()), declared.names,
                            declared.single, of="route")
    if not errors:
        return
    if (authenticate := _authentication(route)) is not None:
        # 401 (and a read-only server's 405) before 422, as for any other invalid parameter: this
        # dependency runs before the route's own.
        await authenticate(request)
    raise RequestValidationError(errors)


checked_query = Depends(_checked_query)
"""The dependency every API route takes (`create_app`)."""
