"""Bad configs fail before any compilation, naming the field, the value and the fix."""

import os
import subprocess
import sys

import pytest

from experiments import hierarchical_assistant
from flexmarl.config import ConfigError
from flexmarl.run import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fails(config, tmp_path, *needles):
  workdir = tmp_path / 'run'
  with pytest.raises(ConfigError) as err:
    train(config, str(workdir), log=lambda *_: None)
  for needle in needles:
    assert needle in str(err.value), str(err.value)
  assert not workdir.exists(), 'nothing may be written before the config is checked'


@pytest.mark.quick
def test_micro_batch_must_divide_global_batch(tmp_path):
  c = hierarchical_assistant.get_config()
  c.agents.sorter.micro_batch = 32  # global 48
  _fails(c, tmp_path, 'agents.sorter.micro_batch', '32', 'divide global_batch=48', '[8, 16, 24, 48]')


def test_micro_batch_must_not_split_groups(tmp_path):
  c = hierarchical_assistant.get_config()
  c.agents.adder.micro_batch = 12
  _fails(c, tmp_path, 'agents.adder.micro_batch', 'group_size=8')


def test_unknown_agent_in_workflow(tmp_path):
  c = hierarchical_assistant.get_config()
  c.workflow.specialists = [('reverse', 'flipper'), ('sort', 'sorter'), ('add', 'adder')]
  _fails(c, tmp_path, "agent 'flipper'", 'config.agents')


def test_more_devices_than_exist(tmp_path):
  c = hierarchical_assistant.get_config()
  c.agents.router.mesh_shape = (4, 4)  # even a training pool needs 16 + 1 devices
  _fails(c, tmp_path, 'mesh_shape', 'needs about 38', 'XLA_FLAGS',
         'Fitting the team to 8 devices failed too', '17 devices')


def test_separate_rollout_devices_need_their_own(tmp_path):
  c = hierarchical_assistant.get_config()  # 4 agents x 1 device, twice: 8 of 8
  c.agents.router.mesh_shape = (2, 1)
  c.placement = 'strict'  # 'fit' would share the training devices
  _fails(c, tmp_path, 'needs about 10', 'rollout.devices=shared', "placement='strict'")
  c.placement = 'tight'
  _fails(c, tmp_path, "config.placement='tight'", "'fit'", "'strict'")
  c = hierarchical_assistant.get_config()
  c.rollout.devices = 'elsewhere'
  _fails(c, tmp_path, "rollout.devices='elsewhere'", "'separate'")


def test_zero_sized_mesh(tmp_path):
  c = hierarchical_assistant.get_config()
  c.agents.router.mesh_shape = (0, 1)
  _fails(c, tmp_path, 'agents.router.mesh_shape', '(0, 1)')


def test_unknown_schedule_and_bad_numbers(tmp_path):
  c = hierarchical_assistant.get_config()
  c.schedule = 'fastest'
  _fails(c, tmp_path, "schedule='fastest'", "'sync'")
  for bad in ('async:0', 'async:two', 'async'):
    c = hierarchical_assistant.get_config()
    c.schedule = bad
    _fails(c, tmp_path, f"schedule='{bad}'", 'k >= 1', 'flexmarl')
  c = hierarchical_assistant.get_config()
  c.agents.sorter.sampling.temperature = 0.0
  _fails(c, tmp_path, 'agents.sorter.sampling.temperature', 'must be > 0')
  c = hierarchical_assistant.get_config()
  c.workflow.specialists = [('add', 'adder'), ('juggle', 'reverser')]
  _fails(c, tmp_path, 'juggle', 'known families')


def test_specialists_keep_the_order_of_the_file(tmp_path):
  """The order sets the Zipf skew and the router's indices: the first pair is the most
  frequent family and the router's '0'. config.json holds that same order."""
  from flexmarl.runtime.workdir import config_values
  from flexmarl.workflows import build_workflow
  c = hierarchical_assistant.get_config()
  workflow = build_workflow(c.workflow)
  assert workflow.families == ['reverse', 'sort', 'add']
  assert workflow.probs[0] > workflow.probs[1] > workflow.probs[2]
  saved = config_values(c)  # what config.json holds
  assert [f for f, _ in saved['workflow']['specialists']] == workflow.families


def test_a_dict_of_specialists_is_refused(tmp_path):
  c = hierarchical_assistant.get_config()
  c.workflow = dict(name='hierarchical_assistant', router='router',
                    specialists={'sort': 'sorter', 'add': 'adder'})  # as a user might write
  _fails(c, tmp_path, 'workflow.specialists is a dict', 'ConfigDict sorts',
         "specialists=[('add', 'adder'), ('sort', 'sorter')]")


@pytest.mark.parametrize('flag,needle', [
    ('--config.no_such_field=1', 'no_such_field'),
    ('--config.steps=many', 'steps'),
    ('--config.rollout.queries_per_wave=8', 'renamed: use --config.rollout.query_concurrency'),
    ('--config.rollout.max_waves=2', 'renamed: use --config.rollout.max_step_queries'),
    ('--config.rollout.admission=waves', 'removed: the rollout always streams; drop the field'),
])
def test_command_line_overrides_are_checked(tmp_path, flag, needle):
  out = subprocess.run(
      [sys.executable, '-m', 'flexmarl.main', '--config=experiments/hierarchical_assistant.py',
       f'--workdir={tmp_path}/run', flag], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert needle in out.stderr
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('name', ['hierarchical_assistant', 'solver_verifier'])
@pytest.mark.parametrize('arg', ['', 'runlocal'])
def test_experiment_configs_are_valid(name, arg):
  import importlib

  import jax

  from flexmarl.config import build_team_spec, check_prompt_lengths
  from flexmarl.models.tokenizer import build_char_tokenizer
  from flexmarl.workflows import build_workflow
  from flexmarl.workflows.checks import check_workflow
  config = importlib.import_module(f'experiments.{name}').get_config(arg)
  workflow = build_workflow(config.workflow)
  tokenizer = build_char_tokenizer()
  spec = build_team_spec(config, tokenizer.vocab_size, [d.id for d in jax.devices()],
                         workflow.agent_names())
  assert set(spec.agents) == set(workflow.agent_names())
  # The dry run of the workflow, and its prompts against max_prompt_len.
  requests = check_workflow(workflow, {n: a.group_size for n, a in spec.agents.items()}, 0)
  check_prompt_lengths(requests, tokenizer, spec.max_prompt_len)


def test_the_spec_is_checked_before_jax_starts(tmp_path):
  """`team_spec` reads the whole config and starts no JAX backend (so GPU memory shares
  can still be set after it); `place_team` then places it on the devices."""
  code = (
      'from experiments import hierarchical_assistant\n'
      'from flexmarl.config import place_team, team_spec\n'
      'from flexmarl.run import _jax_started\n'
      'from flexmarl.models.tokenizer import build_char_tokenizer\n'
      'from flexmarl.workflows import build_workflow\n'
      'config = hierarchical_assistant.get_config("runlocal")\n'
      'spec = team_spec(config, build_char_tokenizer().vocab_size,\n'
      '                 build_workflow(config.workflow).agent_names())\n'
      'assert spec.placement is None and not _jax_started()\n'
      'import jax\n'
      'placed = place_team(spec, [d.id for d in jax.devices()])\n'
      'assert set(placed.placement.train) == set(spec.agents), placed.placement\n'
      'print("ok")\n')
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': ROOT}
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
  assert out.stdout.strip() == 'ok', out.stderr[-2000:]


def test_default_sections_are_generated_from_the_spec_dataclasses():
  """A field and its default are written once, on a part's spec dataclass: the default
  config sections read back as those defaults, and an optional field with no value is
  a typed placeholder, so that a command-line flag can set it."""
  from flexmarl.config import (AgentSpec, RolloutSpec, TrainingSpec, agent_config,
                               rollout_config, training_config)
  from flexmarl.rollout.spec import SamplingParams
  from flexmarl.train.spec import GRPOConfig, OptimizerConfig
  assert RolloutSpec.from_config(rollout_config()) == RolloutSpec()
  assert TrainingSpec.from_config(training_config()) == TrainingSpec()
  a = AgentSpec.from_config('a', agent_config(), 64)
  assert (a.sampling, a.optimizer) == (SamplingParams(), OptimizerConfig())
  assert a.grpo == GRPOConfig(max_new_tokens=SamplingParams().max_new_tokens)
  assert (a.group_size, a.global_batch, a.micro_batch) == (8, 64, 16)
  assert set(agent_config().grpo) == {'credit', 'turn_reward_coef', 'turn_discount',
                                      'advantage', 'clip_eps', 'clip_eps_low', 'clip_eps_high', 'kl_coef',
                                      'entropy_coef', 'entropy_by_error',
                                      'entropy_decay_steps', 'normalize_std',
                                      'loss_norm', 'dynamic_sampling',
                                      'skip_without_signal', 'unstick_below',
                                      'unstick_after', 'collapse_share',
                                      'collapse_after', 'collapse_resets', 'balance_answers',
                                      'zero_spread_baseline', 'self_imitation', 'self_imitation_key',
                                      'tis_cap'}  # not the derived
  c = agent_config()
  c.grpo.clip_eps_high = 0.28
  with pytest.raises(TypeError):
    c.grpo.clip_eps_low = 'low'
  assert AgentSpec.from_config('a', c, 64).grpo.clip_range == (0.2, 0.28)
