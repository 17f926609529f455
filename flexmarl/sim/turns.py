"""Agents one after another (what MAS-RL-like frameworks do): a schedule for the simulator.

A team step is one turn per agent, in team order. In its turn an agent's batch is
rolled out afresh (the whole workflow runs, every agent serving its current weights,
until every batch is full, as under `sync`), then only that agent trains and publishes.
The other agents' rows of that rollout are dropped: the next agent must learn from the
team as it is after this update. It is the real `Sync` schedule with its training
narrowed to the agent in turn, run once per agent.
"""

from __future__ import annotations

from flexmarl.schedules import Lines, StepContext, StepResult, Sync


class AgentsInTurn(Sync):

  turn = ''  # the agent whose turn it is

  def train(self, ctx, full, updates):
    if self.turn not in full:
      return {}
    return super().train(ctx, [self.turn], updates)

  def run_step(self, ctx: StepContext) -> StepResult:
    lines: Lines = {}
    rollout_s, queries, tokens = 0.0, 0, 0
    for name in self.agents:
      self.turn = name
      self.buffers = {n: self.new_buffer(a) for n, a in self.agents.items()}
      turn = super().run_step(ctx)
      lines[name] = turn.lines[name]
      rollout_s += turn.rollout_s
      queries += turn.queries
      tokens += turn.tokens
    return StepResult(lines, rollout_s, queries, tokens)
