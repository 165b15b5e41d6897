"""What a run costs: worker-hours paid for, and dollars per million trained tokens.

Owns summary.json's ``cost`` (``usd``, ``worker_hours``, ``usd_per_million_tokens``,
``goodput_usd_per_million_tokens``, ``cost_per_worker_hour``), refreshed by the step ledger
(``Steps``) at each ``train.log_every_steps`` write and by the Supervisor at the end. Pure: no
Ray, no clock of its own (the caller passes ``now``), so the arithmetic is tested alone.

Paid time is the integral of the workers held over wall time: every slot the run holds (members,
newcomers still starting, members on standby) from the moment the first gang is placed until
teardown, so the idle time of a rebuild, a restore or a resize is paid like a step. The held
count is piecewise constant between the moments the caller reports it (every commit and every
state transition), which is where it changes.

The price is the spec's ``resources.cost_per_worker_hour``. A job service job is priced as the
flavor it was admitted on: its launch sets that field to the flavor's price for the job's worker
(``service.flavors.ResourceFlavor.usd_per_worker_hour``: CPUs, GPUs and GB at the flavor's hourly
rates), so spot and on-demand runs of the same job cost apart.

Two prices per token: the plain one divides by every token trained (steps redone after a
restore count twice, as they were paid twice); the goodput one by the tokens of the committed
steps only, so it is the higher one whenever a failure made work be thrown away.
"""

from __future__ import annotations


class CostMeter:
    def __init__(self, cost_per_worker_hour: float):
        self.cost_per_worker_hour = cost_per_worker_hour
        self.worker_s = 0.0
        self.trained_tokens = 0  # every commit, steps later redone included
        self._held = 0
        self._since: float | None = None  # when ``_held`` was last reported
        self._step_tokens: list[int] = []  # tokens of committed step i+1 at index i (this invocation)

    @property
    def priced(self) -> bool:
        return self.cost_per_worker_hour > 0

    def hold(self, workers: int, now: float) -> None:
        """From ``now`` on the run holds ``workers`` slots."""
        if self._since is not None:
            self.worker_s += self._held * max(0.0, now - self._since)
        self._held, self._since = workers, now

    def committed(self, step: int, tokens: int) -> None:
        """Step ``step`` (1-based) was committed, having trained ``tokens`` tokens."""
        self.trained_tokens += tokens
        if len(self._step_tokens) < step - 1:  # a resume: the steps before it ran in an earlier invocation
            self._step_tokens += [0] * (step - 1 - len(self._step_tokens))
        del self._step_tokens[step - 1:]
        self._step_tokens.append(tokens)

    def rewind(self, step: int) -> None:
        """The ledger went back to ``step`` (a restore): the steps after it are no longer goodput."""
        del self._step_tokens[step:]

    def record(self, now: float) -> dict[str, float]:
        """summary.json's ``cost`` as of ``now``; empty when no price is configured."""
        if not self.priced:
            return {}
        self.hold(self._held, now)
        usd = self.worker_s / 3600.0 * self.cost_per_worker_hour
        good = sum(self._step_tokens)
        return {"usd": usd, "worker_hours": self.worker_s / 3600.0,
                "usd_per_million_tokens": usd / self.trained_tokens * 1e6 if self.trained_tokens else 0.0,
                "goodput_usd_per_million_tokens": usd / good * 1e6 if good else 0.0,
                "cost_per_worker_hour": self.cost_per_worker_hour}
