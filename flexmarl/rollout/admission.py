"""Admission by demand: a step's rollout starts a query only while some agent's batch can
still take its rows, so that nothing is generated only to be thrown away.

A training step ends as soon as every agent's global batch is full; under the on-policy
schedules the rows an agent is served after that (surplus) and the queries still in
flight (cut, served again next step) were generated in vain. The engine therefore keeps,
per agent, the rows its batch still takes (`need`, read from the schedule's buffers)
less the rows the queries it started will bring (`plan`), and decides for each next
query, in stream order:

- *start* it, telling the workflow which of its agents' rows are still wanted
  (`agents[name].wanted`; a workflow may leave out a call whose rows nobody wants and
  whose answer it does not need);
- *hold* it: its rows look unneeded, so nothing more starts until the queries in flight
  are in (then the need is known exactly and the query is decided again);
- *skip* it, only then: it is consumed without running, as no agent it would reach
  needs rows.

A workflow that declares a query's calls before it runs (`workflow.demand(query)`:
agent → generate calls, each one group of the agent's group size) gets the three. For
one that does not, the engine estimates the rows a query brings from the queries it has
seen (`Observed`) and only holds: such a query always runs, with every agent wanted.

Exactness: what a step trains on must depend on the query stream alone, never on
timing. Holding changes only when work runs. The *wanted* sets and skips are decided
from the declared calls and from the need read at quiet moments (nothing in flight,
every result consumed), and both depend only on the stream: `sync` and `flexmarl`, a
resumed run and an uninterrupted one, one query at a time and sixteen, decide alike.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable, Mapping


class Decision(enum.Enum):
  START = 'start'
  HOLD = 'hold'
  SKIP = 'skip'


@dataclasses.dataclass(frozen=True)
class Verdict:
  decision: Decision
  wanted: frozenset[str] | None = None  # the agents whose rows are wanted; None: every one


class Observed:
  """Rows per query and agent, from the training queries an engine has finished: the
  estimate for queries that declare no demand (timing only, never what is trained)."""

  def __init__(self):
    self.rows: collections.Counter = collections.Counter()
    self.queries = 0

  def add(self, rows: Mapping[str, int]) -> None:
    self.rows.update(rows)
    self.queries += 1

  def per_query(self) -> dict[str, float]:
    return {a: r / self.queries for a, r in self.rows.items()} if self.queries else {}


class Admission:
  """One step's admission (see the module docstring). `need()` gives, per agent, the rows
  its batch still takes, as of the results consumed so far."""

  def __init__(self, need: Callable[[], Mapping[str, int]], group_sizes: Mapping[str, int],
               observed: Observed):
    self._need, self.group_sizes, self.observed = need, dict(group_sizes), observed
    self.plan = dict(need())  # rows still to ask for, after the queries started

  def consider(self, calls: Mapping[str, int] | None, quiet: bool) -> Verdict:
    """The next query's verdict. `calls`: its declared generate calls per agent (None:
    not declared); `quiet`: nothing is in flight and every result is consumed."""
    if quiet:  # the need is known exactly: plan from it
      self.plan = dict(self._need())
    if calls is None:
      if not quiet and all(self.plan.get(a, 0) <= 0 for a in self.plan):
        return Verdict(Decision.HOLD)
      for agent, rows in self.observed.per_query().items():
        self.plan[agent] = self.plan.get(agent, 0) - rows
      return Verdict(Decision.START)
    wanted = frozenset(a for a, c in calls.items() if c > 0 and self.plan.get(a, 0) > 0)
    if not wanted:
      return Verdict(Decision.SKIP if quiet else Decision.HOLD)
    for agent in wanted:
      self.plan[agent] -= calls[agent] * self.group_sizes[agent]
    return Verdict(Decision.START, wanted)

