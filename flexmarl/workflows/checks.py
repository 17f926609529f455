"""Checks of a user's workflow, before any work and on every episode it returns.

A workflow is user code: a mistake in it (a reward given as a string, a completion
scored twice, a sample left unscored, a `run` that is not async) must stop the run
with the query, the field and the fix, not train on garbage. `check_workflow` runs
before anything is built: it makes a few queries and runs the workflow on them with
stand-in agents that answer every request with empty completions (an answer a real
policy can give too: EOS first), under a timeout. `check_episode` is the per-episode
check the rollout engine applies to what `run` returns.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from flexmarl.core.errors import ConfigError
from flexmarl.data.sample_id import sample_id
from flexmarl.models.tokenizer import Prompt, check_messages
from flexmarl.workflows.base import Completion, Episode, Query, Workflow, reward_value


class WorkflowError(ValueError):
  """A workflow broke its contract; the message names the query, the field and the fix."""


def check_episode(query_id: str, served_sample_ids: Iterable[str], episode: object) -> None:
  """Raise WorkflowError unless `episode` scores every served sample once, with a finite
  number, and nothing else."""
  if not isinstance(episode, Episode):
    raise WorkflowError(f'query {query_id}: workflow.run returned {type(episode).__name__} '
                        f'({episode!r:.80}); return the Episode you scored the completions in.')
  served = set(served_sample_ids)
  invented = sorted(set(episode.rewards) - served)
  if invented:
    raise WorkflowError(f'query {query_id}: the workflow scored samples that were never served: '
                        f'{invented[:5]}; score only the Completions generate() returned.')
  unscored = sorted(served - set(episode.rewards))
  if unscored:
    raise WorkflowError(f'query {query_id}: served samples without a reward: {unscored[:5]}; '
                        'score every completion the workflow received '
                        '(episode.score(completion, reward)).')
  for sid, reward in episode.rewards.items():
    try:
      reward_value(reward, sid)
    except (TypeError, ValueError) as e:
      raise WorkflowError(f'query {query_id}: episode.rewards[{sid!r}]: {e}') from None
  if not served:
    raise WorkflowError(f'query {query_id}: the workflow never called generate(); a run '
                        'without samples trains nothing: await agents[name].generate(prompt).')
  attempts = set(episode.episode_of.values())
  without, empty = sorted(attempts - set(episode.outcomes)), sorted(set(episode.outcomes) - attempts)
  if without:
    raise WorkflowError(f'query {query_id}: attempts {without} have turns but no outcome; give '
                        'each attempt episode.outcome(i, value).')
  if empty:
    raise WorkflowError(f'query {query_id}: attempts {empty} have an outcome but no turn; score '
                        'their completions with episode.score(c, reward, episode=i).')


def run_error(query_id: str, error: BaseException, fix: str = '') -> WorkflowError:
  """An exception raised inside `workflow.run`, with the query it happened on."""
  return WorkflowError(f'query {query_id}: workflow.run raised {type(error).__name__}: {error} '
                       f'{fix or "(see the traceback above); fix the workflow."}')


def timeout_error(query_id: str, seconds: float, context: str = '') -> WorkflowError:
  """A query whose episode did not finish in time (it awaits something that never does)."""
  return WorkflowError(f'query {query_id}: workflow.run did not finish within {seconds:g}s'
                       f'{" " + context if context else ""}; it awaits something that never '
                       'completes (or raise the per-query timeout).')


class _StandIn:
  """An agent that answers every request with `n` empty completions, recording prompts."""

  wanted = True  # a dry run runs every call

  def __init__(self, name: str, group_size: int, query_id: str, log: list):
    self.name, self.group_size, self.query_id, self.log = name, group_size, query_id, log

  async def generate(self, prompt: Prompt, n: int | None = None, *,
                     max_new_tokens: int | None = None, stop=()) -> list[Completion]:
    n = self.group_size if n is None else n
    try:
      if isinstance(prompt, str) and not prompt:
        raise ValueError('give a non-empty string, or chat messages')
      if not isinstance(prompt, str):
        check_messages(prompt)
    except ValueError as e:
      raise WorkflowError(f'query {self.query_id}: agents[{self.name!r}].generate(prompt='
                          f'{prompt!r}): {e}') from None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise WorkflowError(f'query {self.query_id}: agents[{self.name!r}].generate(n={n!r}): '
                          'n must be a whole number >= 1 (default: the agent\'s group_size).')
    call = len(self.log)
    self.log.append((self.name, prompt, [sample_id(self.query_id, call, j) for j in range(n)]))
    return [Completion(sid, self.name, '', 0) for sid in self.log[-1][2]]


class _Agents(dict):
  """`agents[name]` for a dry run; an unknown name raises naming the configured ones."""

  def __init__(self, query_id: str, agents: Mapping[str, _StandIn]):
    super().__init__(agents)
    self.query_id = query_id

  def __missing__(self, name):
    raise WorkflowError(f'query {self.query_id}: the workflow asked for agent {name!r}; '
                        f'configured agents: {sorted(self)}. Add it to config.agents (and '
                        'agent_names()) or fix the name.')


def make_query_checked(workflow: Workflow, rng: np.random.Generator, query_id: str) -> Query:
  """`workflow.make_query`, with what it did wrong named."""
  try:
    query = workflow.make_query(rng, query_id)
  except Exception as e:  # noqa: BLE001 — user code
    raise WorkflowError(f'workflow.make_query(rng, {query_id!r}) raised {type(e).__name__}: '
                        f'{e}; fix make_query (its task arguments come from config.workflow).'
                        ) from e
  if not isinstance(query, Query):
    raise WorkflowError(f'workflow.make_query(rng, {query_id!r}) returned '
                        f'{type(query).__name__}; return flexmarl.workflows.base.Query('
                        'query_id, prompt, answer, ...).')
  if not isinstance(query.prompt, str) or not query.prompt:
    raise WorkflowError(f'query {query_id}: make_query gave prompt={query.prompt!r}; give a '
                        'non-empty string.')
  return query


def dry_run(workflow: Workflow, group_sizes: Mapping[str, int], seed: int, queries: int = 4,
            timeout_s: float = 10.0, episodes: list | None = None
            ) -> list[tuple[str, str, list[str]]]:
  """Run the workflow on its first `queries` queries against stand-in agents; returns every
  request as (agent, prompt, sample_ids), and appends each query's Episode to `episodes`.
  Raises WorkflowError on a broken contract."""
  async def one(i: int) -> list:
    query = make_query_checked(workflow, np.random.default_rng([seed, i]), f'q{i}')
    log: list = []
    agents = _Agents(query.query_id,
                     {n: _StandIn(n, g, query.query_id, log) for n, g in group_sizes.items()})
    try:
      episode = await asyncio.wait_for(workflow.run(query, agents), timeout_s)
    except WorkflowError:
      raise
    except asyncio.TimeoutError:
      raise timeout_error(query.query_id, timeout_s, 'with agents that answer at once') from None
    except Exception as e:  # noqa: BLE001 — user code
      raise run_error(query.query_id, e, '(with every completion text empty, which a policy '
                      'can answer: EOS first); handle that case.') from e
    check_episode(query.query_id, [s for _, _, ids in log for s in ids], episode)
    check_declared(workflow, query, group_sizes, [name for name, _, _ in log])
    if episodes is not None:
      episodes.append(episode)
    return log

  async def all_queries() -> list:
    return [r for i in range(queries) for r in await one(i)]

  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(all_queries())
  with concurrent.futures.ThreadPoolExecutor(1) as pool:  # inside a notebook's loop
    return pool.submit(asyncio.run, all_queries()).result()


def check_demand(calls: object, query_id: str, agents: Mapping[str, int], workflow: str
                 ) -> Mapping[str, int] | None:
  """A workflow's `demand(query)`, checked: None, or agent → whole number of calls."""
  if calls is None:
    return None
  if not isinstance(calls, Mapping) or not all(
      isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in calls.values()):
    raise ValueError(f'query {query_id}: {workflow}.demand(query) returned {calls!r}; return '
                     'None or a dict agent name -> number of generate calls (>= 0).')
  unknown = sorted(set(calls) - set(agents))
  if unknown:
    raise ValueError(f'query {query_id}: {workflow}.demand(query) names agents {unknown}; '
                     f'configured agents: {sorted(agents)}.')
  return calls


def check_wanted_calls(query_id: str, declared: Mapping[str, int], wanted: Iterable[str],
                       made: Mapping[str, int]) -> None:
  """A query admitted by its declared calls made them, for every agent it was told was
  wanted: the step's plan counts on those rows."""
  short = {a: (declared[a], made.get(a, 0)) for a in wanted if made.get(a, 0) != declared[a]}
  if short:
    raise WorkflowError(
        f'query {query_id}: workflow.demand(query) declared {dict(declared)}, but the '
        f'wanted agents got other calls (declared, made): {short}; make every declared call '
        'of an agent whose `agents[name].wanted` is true, or return None from demand.')


def check_declared(workflow: Workflow, query: Query, group_sizes: Mapping[str, int],
                   called: Sequence[str]) -> None:
  """A workflow that declares its calls (`demand`) makes exactly those: admission plans
  the step's rows by them."""
  if getattr(workflow, 'demand', None) is None:
    return
  try:
    declared = check_demand(workflow.demand(query), query.query_id, group_sizes,
                            type(workflow).__name__)
  except ValueError as e:
    raise WorkflowError(str(e)) from None
  made = collections.Counter(called)
  if declared is not None and {a: n for a, n in declared.items() if n} != dict(made):
    raise WorkflowError(
        f'query {query.query_id}: {type(workflow).__name__}.demand(query) declares the calls '
        f'{dict(declared)}, but the workflow made {dict(made)} with every agent wanted; '
        'declare the calls it makes, or return None where they are not known in advance.')


def check_workflow_api(workflow: Workflow) -> None:
  """The workflow has the methods a run calls: `async run`, `agent_names`, `make_query`."""
  run = getattr(workflow, 'run', None)
  if not inspect.iscoroutinefunction(run):
    raise WorkflowError(f'{type(workflow).__name__}.run is not a coroutine function; define it '
                        'as `async def run(self, query, agents) -> Episode`.')
  for method in ('agent_names', 'make_query'):
    if not callable(getattr(workflow, method, None)):
      raise WorkflowError(f'{type(workflow).__name__} has no {method}() method; see '
                          'flexmarl.workflows.base.Workflow.')
  names = workflow.agent_names()
  if isinstance(names, str) or not isinstance(names, Sequence) or not names:
    raise WorkflowError(f'{type(workflow).__name__}.agent_names() returned {names!r}; return '
                        'a list of the agent names the workflow calls.')


def check_workflow(workflow: Workflow, group_sizes: Mapping[str, int], seed: int = 0,
                   episodes: list | None = None) -> list[tuple[str, str, list[str]]]:
  """Check a workflow against the configured agents (name → group_size) before any work.

  Returns the dry run's requests (see `dry_run`, which collects its `episodes`), for
  prompt and credit checks."""
  check_workflow_api(workflow)
  names = list(workflow.agent_names())
  unknown = [n for n in names if n not in group_sizes]
  if unknown:
    raise ConfigError(f'config.agents: the workflow calls {unknown}, which config.agents does '
                      f'not define (defined: {sorted(group_sizes)}); add them or rename them.')
  idle = [n for n in group_sizes if n not in names]
  if idle:
    raise ConfigError(f'config.agents: {idle} are configured but not in '
                      f'{type(workflow).__name__}.agent_names() {list(names)}; they would '
                      'never train. Remove them from config.agents or add them to agent_names().')
  return dry_run(workflow, {n: group_sizes[n] for n in names}, seed, episodes=episodes)
