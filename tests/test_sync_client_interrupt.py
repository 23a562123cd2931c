"""Ctrl-C (KeyboardInterrupt) in a blocking `SyncClient` call stops the call on the client's loop thread too.

Each case runs in a subprocess (a KeyboardInterrupt in pytest's own process would end the session) and
puts the interrupt at one point of the call deterministically: raised just after the call was handed to
the loop thread, a SIGINT sent to the waiting thread once the call waits, a SIGINT that the loop thread
handles (the kernel may give a process's signal to any thread that does not block it: Python then sets
its flag without waking the waiting thread), and a SIGINT during close(). The subprocess's timeout is
only a guard: every case ends as soon as the interrupted call has."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = r"""
import asyncio, signal, sys, threading
from stepstone import SyncClient
from stepstone.client import Client
from stepstone.store.settled import SettledWatch
from tests import cli_apps

case, url = sys.argv[1], sys.argv[2]
# As a terminal's Ctrl-C finds it: a process started from a background job (as the suite is, in CI) has
# SIGINT ignored, and its children inherit that, so a SIGINT sent here would be dropped.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
main = threading.main_thread().ident
client = SyncClient(url, registry=cli_apps.registry)
instance_id = client.start("approval")  # waits for a signal that never comes
watch, close, wait_for = SettledWatch.watch, Client.close, Client.wait_for
ended = []  # how the wait_for call ended on the loop thread


async def waiting_for(self, *args):
    try:
        return await wait_for(self, *args)
    except BaseException as exc:
        ended.append(type(exc).__name__)
        raise


async def watching(self, key):  # wait_for has reached its wait: interrupt it there
    event = await watch(self, key)
    signal.pthread_kill(main if case == "waiting" else threading.get_ident(), signal.SIGINT)
    return event


async def closing(self):
    signal.pthread_kill(main, signal.SIGINT)
    await close(self)


def handing(*args, **kwargs):  # the call is handed to the loop thread; Ctrl-C comes right after
    client._loop.call_soon_threadsafe = hand
    hand(*args, **kwargs)
    raise KeyboardInterrupt


if case in ("waiting", "loop thread"):
    SettledWatch.watch = watching
elif case == "handed":
    hand = client._loop.call_soon_threadsafe
    client._loop.call_soon_threadsafe = handing
elif case == "close":
    Client.close = closing
Client.wait_for = waiting_for


async def left():  # the loop's tasks still running once the interrupted call has had 10 s to end
    others = asyncio.all_tasks() - {asyncio.current_task()}
    return len((await asyncio.wait(others, timeout=10))[1]) if others else 0


try:
    if case == "close":
        client.close()
    else:
        client.wait_for(instance_id, timeout=20)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
if case != "close":
    print("left running:", asyncio.run_coroutine_threadsafe(left(), client._loop).result(timeout=30))
    print("the call ended by:", *ended or ["never began"])
    client.close()
print("loop thread alive:", client._thread.is_alive())
"""


@pytest.mark.parametrize("case", ["handed", "waiting", "loop thread", "close"])
def test_an_interrupted_call_stops_on_the_loop_thread_too(database_url: str, case: str) -> None:
    """Ctrl-C in a blocking call left the call running on the client's loop thread: a wait_for went on
    waiting, a start_many went on starting, after the caller had moved on, and at exit Python printed
    "Task was destroyed but it is pending!". An interrupt the loop thread handled was seen only when the
    call ended by itself (here its WaitTimeout after 20 s; in a wait_for of 120 s under a bound of 120 s,
    a hang), and one during close() left close's task pending."""
    done = subprocess.run([sys.executable, "-c", _SCRIPT, case, database_url], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parent.parent, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    if case == "close":
        assert lines == ["interrupted", "loop thread alive: False"]
    else:  # a call stopped before its first step never began (its task was cancelled before it entered)
        ends = ["CancelledError", "never began"] if case == "handed" else ["CancelledError"]
        assert lines[:2] == ["interrupted", "left running: 0"]
        assert lines[2].removeprefix("the call ended by: ") in ends
        assert lines[3:] == ["loop thread alive: False"]
    assert "destroyed but it is pending" not in done.stderr
    assert "never awaited" not in done.stderr
    assert "never retrieved" not in done.stderr
