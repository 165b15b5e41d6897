"""The service's scheduler: a pure function from (snapshot, time) to actions.

No Ray, no database, no clock of its own: ``decide(snapshot, now_s)`` returns ``Admit``,
``Grow``, ``Shrink``, ``Pause`` and ``Wait`` values (``actions``), each with a human-readable
reason, and the reconciler carries them out; ``snapshot`` holds its input (``Snapshot``,
``JobView``, ``Policy``). ``quota`` holds the Kueue-style
arithmetic of teams and cohorts (per flavor and resource), ``ordering`` the named orderings, ``decide`` the pass itself.
"""

from raytrain_sys.service.scheduler.decide import decide
from raytrain_sys.service.scheduler.ordering import (admission_order, effective_priority, growth_order,
                                                     pause_order, shrink_order)
from raytrain_sys.service.scheduler.quota import FlavorQuotas, Quotas, never_fits_reason, team_ceiling_workers

__all__ = ["decide", "admission_order", "effective_priority", "growth_order", "pause_order", "shrink_order",
           "FlavorQuotas", "Quotas", "never_fits_reason", "team_ceiling_workers"]
