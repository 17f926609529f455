"""A prompt into its agent's budget (`max_prompt_len`), by the configured policy.

A multi-turn conversation grows with every turn, and the budget is fixed (a compiled
prompt width, a vLLM `max_model_len`). A prompt is never cut silently: under
`rollout.context_overflow='refuse'` (the default) an over-long prompt is an error naming
the query, the agent and the turn; under 'drop_oldest' the oldest turns of chat messages
go first (system messages and the last message stay), and a prompt that still does not
fit is refused the same way. A sampled turn from another agent, whose ids are another
vocabulary, goes in as its text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flexmarl.models.tokenizer import Prompt, TextTokenizer, is_sampled_turn

OVERFLOW_POLICIES = ('refuse', 'drop_oldest')


def own_turns(prompt: Prompt, agent: str, tokenizers: Mapping[str, TextTokenizer]) -> Prompt:
  """`prompt` with each sampled turn whose tokens `agent`'s tokenizer cannot read (one
  of an agent with another tokenizer) replaced by its text."""
  if isinstance(prompt, str):
    return prompt
  mine = tokenizers[agent]

  def readable(content: Any) -> bool:
    return tokenizers.get(getattr(content, 'agent', agent), mine) is mine
  return [dict(m, content=m['content'].text)
          if is_sampled_turn(m.get('content')) and not readable(m['content']) else m
          for m in prompt]


def drop_oldest_turn(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
  """The messages less their oldest turn (the first non-system message, and the
  assistant answer right after it), keeping system messages and the last message; None
  when nothing is left to drop."""
  body = [i for i, m in enumerate(messages) if m['role'] != 'system']
  if len(body) < 2:
    return None
  drop = {body[0]}
  if len(body) > 2 and messages[body[1]]['role'] == 'assistant':
    drop.add(body[1])
  return [m for i, m in enumerate(messages) if i not in drop]


def fit_prompt(prompt: Prompt, encode: Callable[[Prompt], list[int]], limit: int,
               policy: str, where: str) -> list[int]:
  """The ids of `prompt` within `limit` tokens (0: no limit), by `policy`; `where` names
  the query, agent and turn in the error."""
  ids = encode(prompt)
  if not limit or len(ids) <= limit:
    return ids
  first = len(ids)
  if policy == 'drop_oldest' and not isinstance(prompt, str):
    messages = list(prompt)
    while len(ids) > limit and (messages := drop_oldest_turn(messages)) is not None:
      ids = encode(messages)
    if len(ids) <= limit:
      return ids
  fix = ("set rollout.context_overflow='drop_oldest' (chat messages only), "
         if policy == 'refuse' else '')
  raise ValueError(f'{where}: the prompt is {first} tokens' + (
      f' ({len(ids)} with its oldest turns dropped)' if len(ids) != first else '')
      + f', more than max_prompt_len={limit}. Fix: raise config.max_prompt_len, {fix}or '
      'shorten the conversation (fewer turns, shorter feedback).')
