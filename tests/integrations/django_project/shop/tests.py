"""Run by Django's test runner: tasks enqueued on stepstone, committed and rolled back with Django's
transaction, run by a stepstone worker, results read back through the backend."""

import asyncio
import importlib
import os
import subprocess
import threading
import uuid
from datetime import timedelta

from django.db import connection, transaction
from django.test import TransactionTestCase, override_settings
from django.utils import timezone

try:
    from django.tasks import default_task_backend, task_backends
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
except ImportError:
    from django_tasks import default_task_backend, task_backends
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist

from shop.tasks import add, double_later, own_status, refuse, with_context
from stepstone.errors import ClientClosed, InstanceNotFound
from stepstone.integrations.django_tasks import _database_url, registry
from stepstone.testing import open_engine


def run_worker(advance=None):
    async def go():
        async with open_engine(_database_url(), registry) as engine:
            if advance:
                await engine.advance(advance)
            await engine.run_until_idle()

    asyncio.run(go())


def closed(client):
    """Whether the SyncClient is closed (an open one answers that no such instance exists)."""
    try:
        client.get(str(uuid.uuid4()))
    except ClientClosed:
        return True
    except InstanceNotFound:
        return False
    raise AssertionError("an instance that no one started")


class StepstoneTasks(TransactionTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        subprocess.run(["stepstone", "db", "migrate", "--database-url", _database_url()], check=True,
                       capture_output=True)
        with connection.cursor() as cursor:
            cursor.execute("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY)")

    @classmethod
    def tearDownClass(cls):
        default_task_backend.close()
        super().tearDownClass()

    def test_the_backend_is_one_of_the_frameworks_in_use(self):
        framework = os.environ["SHOP_TASKS_FRAMEWORK"]  # django.tasks on Django 6, else django_tasks
        backend = importlib.import_module(framework).task_backends["default"]
        self.assertIsInstance(backend, importlib.import_module(f"{framework}.backends.base").BaseTaskBackend)
        self.assertEqual(type(backend).__module__, "stepstone.integrations.django_tasks")

    def test_a_task_that_takes_a_context_gets_its_own_result(self):
        result = with_context.enqueue(7)
        run_worker()
        result.refresh()
        self.assertEqual(result.status, "SUCCESSFUL")
        self.assertEqual(result.return_value, {"id": result.id, "attempt": 1, "status": "RUNNING", "n": 7,
                                               "args": [7]})

    def test_a_task_reads_itself_running_while_it_runs(self):
        """The backend answered READY for a task that was running."""
        result = own_status.enqueue()
        self.assertEqual(result.status, "READY")
        run_worker()
        result.refresh()
        self.assertEqual(result.status, "SUCCESSFUL")
        self.assertEqual(result.return_value, "RUNNING")

    def test_a_priority_is_refused_at_enqueue(self):
        with self.assertRaises(InvalidTask) as refused:
            add.using(priority=5).enqueue(1, 2)
        self.assertIn("priority", str(refused.exception))

    def test_an_async_task_runs_to_its_end(self):
        result = double_later.enqueue(21)
        run_worker()
        result.refresh()
        self.assertEqual(result.status, "SUCCESSFUL")
        self.assertEqual(result.return_value, 42)

    def test_a_task_commits_with_the_transaction_and_runs(self):
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("INSERT INTO orders VALUES ('o-1')")
            result = add.enqueue(2, 3)
            self.assertEqual(result.status, "READY")
        run_worker()
        result.refresh()
        self.assertEqual(result.status, "SUCCESSFUL")
        self.assertEqual(result.return_value, 5)
        self.assertEqual(default_task_backend.get_result(result.id).return_value, 5)

    def test_a_rolled_back_transaction_enqueues_nothing(self):
        try:
            with transaction.atomic():
                result = add.enqueue(1, 1)
                raise RuntimeError("roll back")
        except RuntimeError:
            pass
        with self.assertRaises(TaskResultDoesNotExist):
            default_task_backend.get_result(result.id)

    def test_a_failing_task_is_failed_with_its_error(self):
        result = refuse.enqueue("no stock")
        run_worker()
        result.refresh()
        self.assertEqual(result.status, "FAILED")
        self.assertEqual(result.errors[0].exception_class_path, "builtins.ValueError")
        self.assertIn("no stock", result.errors[0].traceback)

    def test_run_after_waits_on_the_database_clock(self):
        result = add.using(run_after=timezone.now() + timedelta(hours=1)).enqueue(4, 4)
        run_worker()
        result.refresh()
        self.assertEqual(result.status, "READY")
        run_worker(advance=timedelta(hours=2))
        result.refresh()
        self.assertEqual(result.return_value, 8)

    def test_threads_share_one_client(self):
        """Django keeps a backend per thread, and each opened a client of its own (a loop thread and a pool)."""
        shared = default_task_backend.client()
        found, errors = {}, []

        def enqueue(name, n):
            try:
                backend = task_backends["default"]  # this thread's own
                found[name] = (backend, backend.client(), add.enqueue(n, n))
                backend.close()  # this thread's hold: the client stays open for the others
            except Exception as exc:  # noqa: BLE001 - reported by the test below
                errors.append(exc)
            finally:
                connection.close()

        threads = [threading.Thread(target=enqueue, args=(name, n)) for n, name in enumerate("ab", start=1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(errors, [])
        (backend_a, client_a, result_a), (backend_b, client_b, result_b) = found["a"], found["b"]
        self.assertIsNot(backend_a, backend_b)
        self.assertIs(client_a, shared)
        self.assertIs(client_b, shared)
        run_worker()
        result_a.refresh()
        result_b.refresh()
        self.assertEqual((result_a.return_value, result_b.return_value), (2, 4))

    def test_a_change_of_tasks_lets_go_of_the_old_backends_clients(self):
        """A change of TASKS (override_settings here) makes Django drop its backends of every thread without
        closing them: their holds on the shared client stayed, and it stayed open until the process exited."""
        before = default_task_backend.client()  # this thread's backend holds it, alone once the others closed
        other = {"database_url": _database_url(), "schema": "stepstone"}  # the same database, written out
        with override_settings(TASKS={"default": {"BACKEND": "stepstone.integrations.django_tasks.StepstoneBackend",
                                                  "OPTIONS": other}}):
            self.assertTrue(closed(before))
            inside = default_task_backend.client()
            self.assertIsNot(inside, before)
            result = add.enqueue(3, 4)
        self.assertTrue(closed(inside))
        run_worker()
        self.assertEqual(default_task_backend.get_result(result.id).return_value, 7)  # a new backend, a new client

    def test_a_change_of_tasks_leaves_a_call_in_flight_its_client(self):
        """A change of TASKS while another thread's call was in flight closed the shared client under that
        call (ClientClosed); the client now outlives it, and the call's end closes it."""
        before = default_task_backend.client()
        in_flight, go = threading.Event(), threading.Event()
        outcome = {}

        def enqueue():
            backend = task_backends["default"]  # this thread's own
            given = backend._atomic_connection

            def held_in_flight():  # runs inside the call, before its start
                in_flight.set()
                go.wait(timeout=60)
                return given()

            backend._atomic_connection = held_in_flight
            try:
                outcome["result"] = add.enqueue(5, 6)
            except Exception as exc:  # noqa: BLE001 - reported by the test below
                outcome["error"] = exc
            finally:
                connection.close()

        thread = threading.Thread(target=enqueue)
        thread.start()
        self.assertTrue(in_flight.wait(timeout=60))
        other = {"database_url": _database_url(), "schema": "stepstone"}
        with override_settings(TASKS={"default": {"BACKEND": "stepstone.integrations.django_tasks.StepstoneBackend",
                                                  "OPTIONS": other}}):
            self.assertFalse(closed(before))  # no backend holds it; the call in flight still uses it
            go.set()
            thread.join(timeout=60)
            self.assertNotIn("error", outcome)
            self.assertTrue(closed(before))  # closed by the end of the last call on it
        run_worker()
        self.assertEqual(default_task_backend.get_result(outcome["result"].id).return_value, 11)
