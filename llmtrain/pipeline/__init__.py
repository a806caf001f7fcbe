"""Pipeline parallelism: schedules as data and their simulator (pure Python), stage splitting and the
executor (torch; import them from their modules so the planner never pulls torch in)."""

from llmtrain.pipeline.schedules import SCHEDULES, Action, Schedule, build_schedule
from llmtrain.pipeline.simulator import Event, ScheduleError, SimulationResult, simulate

__all__ = [
    "SCHEDULES",
    "Action",
    "Event",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "build_schedule",
    "simulate",
]
