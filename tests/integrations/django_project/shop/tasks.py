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
    return n
