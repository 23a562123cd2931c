"""Framework helpers: an ASGI lifespan for FastAPI and Starlette (`asgi`). Each imports its framework
only when used; stepstone depends on none of them."""
