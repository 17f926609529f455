"""`python -m flexmarl.plan_memory`: XLA's scratch of a train step, added to what each
device group holds, set beside the machine's memory before anything runs."""

import os
import subprocess
import sys

import pytest

from flexmarl import plan_memory
from flexmarl.core.errors import ConfigError
from flexmarl.models.lora import LoRAConfig
from flexmarl.models.transformer import ModelConfig
from flexmarl.train.sizing import train_step_scratch
from flexmarl.train.spec import GRPOConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from experiments import rounds_team  # pylint: disable=g-import-not-at-top,wrong-import-position

CFG = ModelConfig(vocab_size=64, layers=4, mlp=256, lora=LoRAConfig(rank=4, alpha=8.0))


def test_the_scratch_grows_with_the_rows_and_a_kl_reference():
  small, large = (train_step_scratch(CFG, GRPOConfig(), rows, 48, 8) for rows in (4, 16))
  assert 2.5 * small < large, (small, large)
  with_ref = train_step_scratch(CFG, GRPOConfig(kl_coef=0.1), 16, 48, 8)
  assert with_ref > large  # the reference's forward is kept too


def test_plan_adds_each_training_agents_step_to_what_its_group_holds(monkeypatch):
  from flexmarl.runtime.memory import held_bytes, holdings
  monkeypatch.setattr(plan_memory, '_machine_bytes', lambda platform, device: 2**40)
  result = plan_memory.plan(rounds_team.get_config('toy'))
  assert result.fits and result.lines[-1].endswith('fits'), result.lines
  spec = result.spec
  solver = spec.agents['solver']
  assert result.scratch['solver'] == train_step_scratch(
      solver.model, solver.grpo, solver.micro_batch, spec.max_prompt_len,
      solver.sampling.max_new_tokens) > 0
  # Two agents, each training on a device group of its own: on CPU both groups and both
  # steps are in the one host memory at once.
  groups = holdings(spec.agents, spec.placement)[3]
  assert result.need == {'the host': sum(held_bytes(g) for g in groups.values())
                                     + result.scratch['solver'] + result.scratch['verifier']}


@pytest.mark.quick
def test_a_plan_past_the_memory_names_the_fields_that_shrink_it(monkeypatch):
  config = rounds_team.get_config('toy')
  monkeypatch.setattr(plan_memory, '_machine_bytes', lambda platform, device: 2**20)
  lines = plan_memory.plan(config).lines
  assert 'does NOT fit' in lines[-2] and 'micro_batch' in lines[-1] and 'remat' in lines[-1]


def test_a_ray_run_is_refused_with_the_fix():
  config = rounds_team.get_config('toy')
  config.cluster.backend = 'ray'
  with pytest.raises(ConfigError, match="cluster.backend='local'"):
    plan_memory.plan(config)


def test_the_command_prints_the_plan_and_exits_0_when_it_fits():
  out = subprocess.run([sys.executable, '-m', 'flexmarl.plan_memory',
                        '--config=experiments/rounds_team.py:toy'], cwd=REPO,
                       capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "a train step's scratch" in out.stdout and out.stdout.rstrip().endswith('fits')
