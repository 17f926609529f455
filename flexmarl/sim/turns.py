"""Agents one after another (what MAS-RL-like frameworks do): a schedule for the simulator.

A team step is one turn per agent, in team order. In its turn an agent's batch is
rolled out afresh (the whole workflow runs, every agent serving its current weights,
until every batch is full, as under `sync`), then only that agent trains and publishes.
The other agents' rows of that rollout are dropped: the next agent must learn from the
team as it is after this update. It is the real `Sync` schedule with its training
narrowed to the agent in turn, run once per agent.
"""

from __future__ import annotations

from flexmarl.metrics.writer import TEAM
from flexmarl.schedules import Lines, Sync

SUMMED = ('rollout_s', 'queries', 'tokens', 'updated', 'rebalances')


class AgentsInTurn(Sync):

  turn = ''

  def train(self, orch, full, stepped):
    return {self.turn: orch.train_agent(self.turn)} if self.turn in full else {}

  def run_step(self, orch) -> Lines:
    t0 = orch.clock.now()
    turns: dict[str, Lines] = {}
    for name in orch.agents:
      self.turn = name
      for n in orch.buffers:
        orch.buffers[n] = self.new_buffer(orch.spec.agents[n])
      turns[name] = super().run_step(orch)
    lines: Lines = {name: turns[name][name] for name in orch.agents}
    team = dict(turns[name][TEAM])
    team.update({k: sum(t[TEAM][k] for t in turns.values()) for k in SUMMED})
    team['step_time_s'] = orch.clock.now() - t0
    team['train_s'] = team['step_time_s'] - team['rollout_s']
    team['tokens_per_s'] = team['tokens'] / team['step_time_s']
    lines[TEAM] = team
    return lines
