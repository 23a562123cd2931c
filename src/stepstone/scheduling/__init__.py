"""Schedules (cron or fixed interval) and flow limits (concurrency and start rate), stored as rows.

`Schedule` says when a workflow starts; `Client.schedule` stores it and any worker fires it.
`FlowLimit` bounds how many instances of a workflow run at once (per key when given).
"""

from stepstone.scheduling.cron import Cron, CronError
from stepstone.scheduling.operations import FlowLimitInfo, ScheduleInfo
from stepstone.scheduling.schedule import Schedule, ScheduleError

__all__ = ["Cron", "CronError", "FlowLimitInfo", "Schedule", "ScheduleError", "ScheduleInfo"]
