"""The Supervisor and its parts, one owner a module (see supervisor.py for who owns what).

A package rather than a folder beside supervisor.py: ``raytrain_sys.control.supervisor`` stays
the one import path of the names below (cli, tests, benchmarks, the notebook), and the folder
shows a newcomer where a failure is handled (liveness, policy), where a step is committed
(steps) and where the group re-forms (membership).
"""

from raytrain_sys.control.supervisor.checkpoints import FAULT_BEFORE_MANIFEST_ENV
from raytrain_sys.control.supervisor.journal import State
from raytrain_sys.control.supervisor.policy import LIVENESS_EVERY_S, PING_TIMEOUT_S
from raytrain_sys.control.supervisor.requests import RunRequests
from raytrain_sys.control.supervisor.steps import StepReport
from raytrain_sys.control.supervisor.supervisor import (RunResult, Supervisor, resume_job, resume_supervisor,
                                                        run_job)

__all__ = ["FAULT_BEFORE_MANIFEST_ENV", "LIVENESS_EVERY_S", "PING_TIMEOUT_S", "RunRequests", "RunResult", "State",
           "StepReport", "Supervisor", "resume_job", "resume_supervisor", "run_job"]
