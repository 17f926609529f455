"""StarvationWatch: say so when an agent gets no work, and which agent upstream stopped
sending it.

In a workflow one agent's answer decides which agent runs next (a router picks a
specialist). When that agent drifts, a downstream agent can get no rows at all: its
batch cannot fill, it stops training, and its step lines show `r=nan` and nothing else
says why. The other agents still train: a step ends on `rollout.max_step_queries`.

Upstream is read from the queries themselves: the agents a query called before it (by
call order, `ServedGroup.call`) in the last query that reached it; an agent no query
has reached yet is upstream of nothing known, so the warning names the agents that
start the queries (call 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class StarvationWatch:
  """Per agent, counts consecutive steps without a row; warns once when the count
  reaches `patience`, and again after it got rows and starves anew."""

  def __init__(self, agents: Sequence[str], max_step_queries: int, patience: int = 20):
    if patience < 1:
      raise ValueError(f'StarvationWatch(patience={patience}): give a patience >= 1 steps.')
    self.patience, self.max_step_queries = patience, max_step_queries
    self._hungry = dict.fromkeys(agents, 0)  # steps in a row without rows
    self._fed: set[str] = set()  # agents that got rows this step
    self._upstream: dict[str, list[str]] = {}  # agent -> agents called before it, last seen
    self._starters: dict[str, None] = {}  # agents seen at a query's first call
    self._served = dict.fromkeys(agents, 0)  # queries that reached each agent, in all
    # per agent, _served at the end of the last step it got rows (or at the start)
    self._since = {agent: dict(self._served) for agent in agents}

  def served(self, calls: Mapping[str, int]) -> None:
    """One query's rows arrived: `calls` maps each agent it reached to its first call."""
    first = min(calls.values(), default=0)
    for agent, call in calls.items():
      self._fed.add(agent)
      self._served[agent] += 1
      self._upstream[agent] = sorted(a for a, c in calls.items() if c < call)
      if call == first:
        self._starters[agent] = None

  def end_step(self, step: int) -> list[str]:
    """Closes step `step`; returns a warning line per agent that has just starved
    `patience` steps in a row."""
    warnings = []
    for agent in self._hungry:
      if agent in self._fed:
        self._hungry[agent] = 0
        self._since[agent] = dict(self._served)
        continue
      self._hungry[agent] += 1
      if self._hungry[agent] == self.patience:
        warnings.append(self._warning(agent, step))
    self._fed.clear()
    return warnings

  def _warning(self, agent: str, step: int) -> str:
    upstream = self._upstream.get(agent)
    senders = upstream or [a for a in self._starters if a != agent]
    since = self._since[agent]
    named = ', '.join(f'{a!r} ({self._served[a] - since[a]} queries)' for a in senders)
    if upstream:
      why = (f'the agents called before it in the last query that reached it, {named}, '
             'kept serving queries in that time without calling it')
    else:
      why = (f'no query has called it yet; the queries start at {named or "no agent"}, '
             'which never sent it work')
    who = ' or '.join(repr(a) for a in senders) or 'the workflow'
    return (f'step {step}: agent {agent!r} has got no rows for {self.patience} steps, so '
            f'its batch cannot fill and it does not train: {why}. Check what {who} '
            f'answers (e.g. whether it still routes work to {agent!r}). Meanwhile each step '
            f'ends after rollout.max_step_queries={self.max_step_queries} queries and the '
            'other agents train on.')
