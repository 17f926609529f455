"""One step's rollout as the orchestrator consumes it: each query's groups per agent,
journaled to the ExperienceStore as they arrive, up to the step's query limit."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from flexmarl.agent import Agent
from flexmarl.config import TeamSpec
from flexmarl.data.groups import Group, groups_of
from flexmarl.data.journal import Journal
from flexmarl.metrics.starvation import StarvationWatch


class JournaledRollout:
  """One step's rollout as it streams: iterating gives each query's groups per agent
  (only agents it served), in stream order, each group already journaled; it ends after
  `rollout.max_step_queries` queries. `queries` and `tokens` (response tokens per agent)
  count what was consumed so far; `starvation` sees which agents each query reached."""

  def __init__(self, results: Iterator, spec: TeamSpec, journal: Journal,
               starvation: StarvationWatch, agents: Mapping[str, Agent]):
    self._results, self._journal, self._starvation = results, journal, starvation
    self._advantages = {n: a.learner.advantages for n, a in agents.items()}
    self._limit = spec.rollout.max_step_queries
    self.queries = self.skipped = 0
    self.tokens = {n: 0 for n in spec.agents}

  def __iter__(self) -> Iterator[dict[str, list[Group]]]:
    for result in self._results:
      self.queries += 1
      if result.skipped:  # admission by demand: no batch takes its rows
        self.skipped += 1
        yield {}
        if self.queries >= self._limit:
          return
        continue
      arrival = {n: g for n, g in groups_of(result, self._advantages).items() if g}
      self._starvation.served({n: min(g.served.call for g in groups)
                               for n, groups in arrival.items()})
      for name, groups in arrival.items():
        self._journal.record(name, groups)
        self.tokens[name] += sum(len(t) for g in groups for t in g.served.tokens)
      yield arrival
      if self.queries >= self._limit:
        return
