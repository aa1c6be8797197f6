from pdserve.scheduler.policies import POLICIES, Policy, StepPlan, make_policy
from pdserve.scheduler.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

__all__ = ["POLICIES", "Policy", "ScheduledRequest", "Scheduler", "SchedulerOutput", "StepPlan", "make_policy"]
