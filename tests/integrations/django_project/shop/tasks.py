import asyncio

try:
    from django.tasks import default_task_backend, task
except ImportError:
    from django_tasks import default_task_backend, task


@task
def add(a, b):
    return a + b


@task
def refuse(reason):
    raise ValueError(reason)


@task(takes_context=True)
def with_context(context, n):
    result = context.task_result
    return {"id": result.id, "attempt": context.attempt, "status": str(result.status), "n": n,
            "args": result.args}


@task
async def double_later(n):
    await asyncio.sleep(0)  # a real suspension: the task runs on an event loop of its own
    return 2 * n


@task(takes_context=True)
def own_status(context):
    """What the backend says of this task while it runs (the backend of this thread: Django keeps one a
    thread, so it is closed here, else its connections outlive the test database)."""
    try:
        return str(default_task_backend.get_result(context.task_result.id).status)
    finally:
        default_task_backend.close()
