from pdserve.scheduler.policies import POLICIES, Policy, SLOAware, StepPlan, make_policy
from pdserve.scheduler.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from pdserve.scheduler.step_model import StepTimeModel

__all__ = [
    "POLICIES",
    "Policy",
    "SLOAware",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "StepPlan",
    "StepTimeModel",
    "make_policy",
]
