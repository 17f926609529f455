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
- *skip* it: it is consumed without running, as no agent it would reach needs rows;
- *hold* it: nothing more starts until the queries in flight are in and the need is
  known exactly, then the query is decided again: a query whose agents may have groups
  filtered out (dynamic sampling), or any once every batch is planned full.

A workflow that declares a query's calls before it runs (`workflow.demand(query)`:
agent → generate calls, each one group of the agent's group size) gets the three; a
query that declares nothing runs as it always did, every agent wanted, up to
`rollout.query_concurrency` at once. (Holding such queries back on an estimate of the
rows they bring was tried and left out: it changes which requests share a batch with
timing, and on CPU a row's last logprob bits with its batch's size, so a query served
again after a crash no longer matches the row the store holds, which the store refuses.)

Exactness: what a step trains on must depend on the query stream alone, never on
timing. Holding changes only when work runs. The *wanted* sets and skips are decided
from the declared calls (the engine checks that each query made them) and from the need
read at quiet moments (nothing in flight, every result consumed), and both depend only
on the stream: `sync` and `flexmarl`, a resumed run and an uninterrupted one, one query
at a time and sixteen, decide alike. (A workflow declares the calls of every training
query or of none: rows of undeclared queries are not in the plan.)
"""

from __future__ import annotations

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


class Admission:
  """One step's admission (see the module docstring). `need()` gives, per agent, the rows
  its batch still takes, as of the results consumed so far; `filtered`: the agents whose
  groups a batch may drop (DAPO's dynamic sampling), whose rows may fall short of the
  declared ones."""

  def __init__(self, need: Callable[[], Mapping[str, int]], group_sizes: Mapping[str, int],
               filtered: frozenset[str] = frozenset()):
    self._need, self.group_sizes, self.filtered = need, dict(group_sizes), filtered
    # Rows still to ask for after the declared queries started: what decides the
    # wanted sets and skips, so it moves only by declared calls and exact needs.
    self.plan = dict(need())

  def consider(self, calls: Mapping[str, int] | None, quiet: bool) -> Verdict:
    """The next query's verdict. `calls`: its declared generate calls per agent (None:
    not declared: it starts, every agent wanted); `quiet`: nothing is in flight and
    every result is consumed."""
    if calls is None:
      return Verdict(Decision.START)
    wanted = self._wanted(calls)
    if not wanted:
      if quiet:  # everything started is in: plan from the exact need
        self.plan = dict(self._need())
        wanted = self._wanted(calls)
      elif self.filtered & {a for a, c in calls.items() if c > 0}:
        return Verdict(Decision.HOLD)  # filtered groups may leave a batch short
      if not wanted:
        # Skipped while a later query can bring the rows still wanted; once every
        # batch is planned full, held: the step is about to end.
        more = any(rows > 0 for rows in self.plan.values())
        return Verdict(Decision.SKIP if more else Decision.HOLD)
    for agent in wanted:
      self.plan[agent] -= calls[agent] * self.group_sizes[agent]
    return Verdict(Decision.START, wanted)

  def _wanted(self, calls: Mapping[str, int]) -> frozenset[str]:
    return frozenset(a for a, c in calls.items() if c > 0 and self.plan.get(a, 0) > 0)
