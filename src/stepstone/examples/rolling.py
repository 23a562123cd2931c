"""The rolling-deploy example: two versions of one workflow, each deployed on its own workers.

    v1: prepare -> await_go (signal go) -> finish
    v2: prepare -> check -> await_go (signal go) -> finish

`finish` records which worker ran it (the ``STEPSTONE_WORKER_LABEL`` of its process), so the demo can
show that v1 instances finished on v1 workers and v2 instances on v2 workers.
"""

from __future__ import annotations

import os
from typing import Any

from stepstone.authoring.workflow import Registry, StepContext, Workflow

__all__ = ["registry", "v1", "v1_registry", "v2", "v2_registry"]

DEFINITION = "rollout"


def _label() -> str:
    return os.environ.get("STEPSTONE_WORKER_LABEL", f"pid {os.getpid()}")


def _build(version: int) -> Workflow[Any]:
    wf: Workflow[Any] = Workflow(DEFINITION, version=version)

    @wf.step(start=True, next="check" if version > 1 else "await_go")
    async def prepare(_ctx: StepContext, state: dict[str, Any]) -> None:
        state["prepared_by"] = _label()

    if version > 1:
        @wf.step(next="await_go")
        async def check(_ctx: StepContext, state: dict[str, Any]) -> None:
            state["checked"] = True

    wf.wait("await_go", signals={"go": "finish"})

    @wf.step
    async def finish(_ctx: StepContext, state: dict[str, Any]) -> None:
        state["finished_by"] = _label()
        state["code_version"] = version

    return wf


v1 = _build(1)
v2 = _build(2)
v1_registry = Registry(v1)
v2_registry = Registry(v2)
registry = Registry(v1, v2)
"""Both versions: what a client (or a migration) that knows both uses."""
