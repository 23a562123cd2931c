"""A query parameter that takes one value refuses a repeat (every API route's dependency).

Starlette keeps every value of a repeated query parameter, and FastAPI binds a parameter that is not a
list to the LAST of them: ``?workflow=a&workflow=b`` listed only b's instances, and
``?status=FAILED&status=COMPENSATION_FAILED`` (before `status` became a list) only the second status,
silently. A list parameter (``status`` of the instance list, ``state`` of an instance's commands) takes
every value; any other given more than once is refused with 422 InvalidInput naming it, as any other
invalid query parameter is (``loc`` ``["query", name]``).
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, Any, Union, get_args, get_origin

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from stepstone.api.auth import Principal
from stepstone.api.context import principal, writer

__all__ = ["single_values"]

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


def _dependants(dependant: Dependant) -> Iterator[Dependant]:
    """The route's dependant and its dependencies' (the inbox's filters are one), depth first."""
    yield dependant
    for dependency in dependant.dependencies:
        yield from _dependants(dependency)


def _one_valued(route: APIRoute) -> frozenset[str]:
    """The query parameters of the route that take one value."""
    return frozenset(f.alias for d in _dependants(route.dependant) for f in d.query_params
                     if not _takes_many(f.field_info.annotation))


def _authentication(route: APIRoute) -> Callable[[Request], Awaitable[Principal]] | None:
    """The route's `principal` (or `writer`) dependency, if it takes one."""
    calls = [d.call for d in _dependants(route.dependant)]
    return next((c for c in (writer, principal) if c in calls), None)


async def _single_values(request: Request) -> None:
    counted = Counter(name for name, _ in request.query_params.multi_items())
    route = request.scope.get("route")
    if max(counted.values(), default=0) < 2 or not isinstance(route, APIRoute):
        return  # the usual request: no name repeated, nothing to look up
    single = _one_valued(route)
    repeated = [(name, n) for name, n in counted.items() if n > 1 and name in single]
    if not repeated:
        return
    if (authenticate := _authentication(route)) is not None:
        # 401 (and a read-only server's 405) before 422, as for any other invalid parameter: this
        # dependency runs before the route's own.
        await authenticate(request)
    raise RequestValidationError([
        {"loc": ("query", name), "type": "repeated",
         "msg": f"given {n} times; this parameter takes one value"} for name, n in repeated])


single_values = Depends(_single_values)
"""The dependency every API route takes (`create_app`)."""
