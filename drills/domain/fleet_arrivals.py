"""The fleet simulator's clients: each team's Poisson arrivals of a ``ChatWorkload``.

Public surface: ``TeamArrivals``.

One random stream per team: changing one team's rate leaves every other team's
requests exactly as they were, so scenarios compare request for request. A team's
next arrival is drawn from its current rate (the workload's share times the
scenario's factors); a rate change draws afresh, and the draw it supersedes is
recognised by its version and dropped.
"""

from __future__ import annotations

import random

from drills.domain.workload import Arrival, ChatWorkload, Conversations, TeamSpec

__all__ = ["TeamArrivals"]


class TeamArrivals:
    """The arrival streams of one workload's teams, for one ``FleetSim``."""

    def __init__(self, workload: ChatWorkload, seed: int) -> None:
        self.workload = workload
        self._seed = seed
        self._rngs: dict[str, random.Random] = {}
        self._conversations = Conversations(workload, random.Random(seed))
        self._users = workload.team_users()
        self._factor = 1.0
        self._team_factor: dict[str, float] = {}
        self._version: dict[str, int] = {}

    def has_users(self, team: str) -> bool:
        """True for a team of the workload (a trace's or a caller's team has none)."""
        return team in self._users

    def next_at(self, team: TeamSpec, after: float) -> tuple[float, int] | None:
        """Draw ``team``'s next arrival after ``after``: (time, version), or None
        when its rate is zero. Any earlier draw is superseded."""
        rate = (
            self.workload.team_rate(team)
            * self._factor
            * self._team_factor.get(team.name, 1.0)
        )
        version = self._version.get(team.name, 0) + 1
        self._version[team.name] = version
        if rate <= 0:
            return None
        return after + self._rng(team.name).expovariate(rate), version

    def is_current(self, team: str, version: int) -> bool:
        """False for a draw that a rate change superseded."""
        return self._version.get(team) == version

    def arrival(self, team: TeamSpec, now: float) -> Arrival:
        """Return the message of a user of ``team`` drawn at random, at ``now``."""
        users = self._users[team.name]
        user = users.start + self._rng(team.name).randrange(len(users))
        return self._conversations.next_request(user, team, now)

    def set_factor(self, factor: float) -> None:
        """Every team's arrivals run at ``factor`` times the base rate from now."""
        self._factor = factor

    def set_team_factor(self, team: str, factor: float) -> None:
        """``team``'s arrivals run at ``factor`` times its base rate from now."""
        if team not in self._users:
            raise ValueError(f"no team {team!r} in the workload")
        self._team_factor[team] = factor

    def _rng(self, team: str) -> random.Random:
        rng = self._rngs.get(team)
        if rng is None:
            rng = self._rngs[team] = random.Random(f"{self._seed}:{team}")
        return rng
