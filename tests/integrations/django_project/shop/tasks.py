import asyncio

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task


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
