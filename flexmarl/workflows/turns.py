"""Workflows in turns: attempts side by side, and AT-GRPO's best-of-K turn.

A team that works in turns (a solver proposes, a checker answers, the solver revises)
is trained one of two ways (`grpo.credit`, train/credit.py):
- by episode: a query runs `n` attempts side by side, each turn one sample; an agent's
  turns are credited with their attempt's outcome against the other attempts'. The
  first turn asks once for `n` samples and each starts an attempt (`attempts`), so a
  one-turn workflow stores the very rows that call groups would;
- by call (AT-GRPO's agent-and-turn groups): one attempt; at each turn the agent gives
  K candidates, each scored by its turn reward, and the attempt goes on with the best
  (`best_of`).

An agent's own earlier turns go back into its next prompt as the Completions themselves
(`{'role': 'assistant', 'content': completion}`): the prompt then holds the exact tokens
sampled, never the text encoded again. Environment and tool text goes in as user
messages: it is prompt, never trained on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from flexmarl.workflows.base import AgentClient, Completion, Episode


async def attempts(agent: AgentClient, prompt: Any, n: int,
                   attempt: Callable[[int, Completion], Awaitable[Any]]) -> list[Any]:
  """Run `n` attempts side by side: `agent`'s first turn is one call for `n` samples,
  and `attempt(i, first_turn)` carries attempt i on from its sample (scoring its turns
  with `episode=i` and giving `episode.outcome(i, ...)`). Returns their results."""
  first = await agent.generate(prompt, n=n)
  return list(await asyncio.gather(*[attempt(i, c) for i, c in enumerate(first)]))


async def best_of(agent: AgentClient, prompt: Any, k: int, episode: Episode,
                  judge: Callable[[Completion], float | tuple[float, bool]],
                  episode_index: int | None = None, expected: str | None = None,
                  **generate: Any) -> Completion:
  """AT-GRPO's turn: `k` candidates from one call, each scored in `episode` by its turn
  reward (`judge(c)`: a reward, or (reward, correct); `episode_index`: the attempt they
  belong to, where the workflow gives attempts outcomes; `expected`: the turn's right
  answer, where it has one); returns the best-scored (the first of equals, so the choice
  follows the seed)."""
  candidates = await agent.generate(prompt, n=k, **generate)
  rewards = []
  for c in candidates:
    verdict = judge(c)
    reward, correct = verdict if isinstance(verdict, tuple) else (verdict, None)
    episode.score(c, reward, correct=correct, expected=expected, episode=episode_index)
    rewards.append(float(reward))
  return candidates[max(range(len(candidates)), key=lambda j: (rewards[j], -j))]


def conversation(system: str, task: str, turns: Sequence[tuple[Completion, str]]
                 ) -> list[dict[str, Any]]:
  """Chat messages of an agent's conversation so far: the task, then each of its own
  turns (exact tokens) followed by the feedback it got."""
  messages: list[dict[str, Any]] = [{'role': 'system', 'content': system}] if system else []
  messages.append({'role': 'user', 'content': task})
  for turn, feedback in turns:
    messages += [{'role': 'assistant', 'content': turn}, {'role': 'user', 'content': feedback}]
  return messages
