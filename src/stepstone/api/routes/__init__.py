"""The API's routers, one module per area; `stepstone.api.app.ROUTERS` mounts each under /api/v1.

A feature adds its endpoints as one more module here exposing ``router`` (an APIRouter) and one line
in ROUTERS: tasks, messages, retention, bulk actions and the operator's queries plug in that way.
"""
