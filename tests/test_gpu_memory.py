"""GPU memory shares: planned from what runs on the first GPU, the user's values kept,
and clear errors naming both numbers when they cannot add up or cannot hold what the
placement puts in them. (Pure functions: no GPU needed.)"""

import dataclasses

import pytest

from experiments import hierarchical_assistant
from flexmarl.config import build_team_spec
from flexmarl.core.errors import ConfigError
from flexmarl.models.tokenizer import build_char_tokenizer
from flexmarl.rollout import vllm_check
from flexmarl.runtime import gpu_memory as gm
from flexmarl.train.sizing import param_count, state_nbytes
from flexmarl.workflows import build_workflow


@pytest.mark.quick
@pytest.mark.parametrize('engines, environ, given, jax_share, vllm_share, env', [
    (0, {}, None, 0.9, 0.0, {'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.9'}),
    (4, {}, None, 0.18, 0.18, {'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.18'}),
    (2, {'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.5'}, None, 0.5, 0.2, {}),
    (2, {'XLA_CLIENT_MEM_FRACTION': '0.3'}, None, 0.3, 0.3, {}),
    (2, {}, 0.3, 0.3, 0.3, {'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.3'}),
    (0, {'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.95'}, None, 0.95, 0.0, {}),
])
def test_plan_shares_the_first_gpu_and_keeps_the_users_values(engines, environ, given,
                                                              jax_share, vllm_share, env):
  s = gm.plan(engines, environ, given)
  assert (s.jax, s.vllm, s.engines) == pytest.approx((jax_share, vllm_share, engines))
  assert s.env() == env
  assert s.preallocate
  text = s.describe()
  assert f'{jax_share:.4g}' in text and ('(yours)' in text) == bool(environ or given)
  assert ('vLLM engine' in text) == bool(engines)


@pytest.fixture(autouse=True)
def as_on_a_gpu(monkeypatch):
  """Specs with rollout.backend=vllm are planned as on a GPU: no CPU attention head-size
  limit (the tiny model's heads are 16 wide) stands in front of the memory checks."""
  monkeypatch.setattr(vllm_check, 'cpu_head_sizes', lambda: None)


@pytest.mark.extra('vllm')  # specs with rollout.backend=vllm check the install
def test_shares_that_do_not_add_up_are_refused_on_a_gpu():
  bad = gm.plan(2, {'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.75'}, 0.5)
  assert bad.env() == {}  # nothing set; CPU runs ignore the shares, GPU runs check them
  with pytest.raises(ConfigError, match=r'XLA_PYTHON_CLIENT_MEM_FRACTION=0\.75 \(JAX\) and '
                     r'rollout\.vllm\.gpu_memory_utilization=0\.5 for each of 2 .*1\.75'):
    bad.check()
  with pytest.raises(ConfigError, match=r'FRACTION=0\.9 \(JAX\) leaves 0 of 0\.9 .* for vLLM'):
    gm.plan(1, {'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.9'}).check()
  with pytest.raises(ConfigError, match=r"XLA_CLIENT_MEM_FRACTION='lots': give a fraction"):
    gm.plan(0, {'XLA_CLIENT_MEM_FRACTION': 'lots'}).check()
  with pytest.raises(ConfigError, match=r'utilization=0\.3 for each of 4 .* leaves -0\.3 of '
                     r'0\.9 of it for JAX'):
    gm.settle(_spec(1, backend='vllm'), gm.plan(4, {}, 0.3), 10**12)
  gm.plan(4, {}).check()
  assert not gm.plan(0, {'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'}).preallocate


def test_check_fits_names_both_numbers():
  shares = gm.plan(1, {})  # 0.45 each
  gm.check_fits(shares, 10**10, {0: {'router state': 4 * 10**9}}, {'router/0': 4 * 10**9})
  with pytest.raises(ConfigError, match=r'GPU 0: JAX gets 0\.45 of it \(4\.5 GB\).*at least '
                     r'6 GB \(router state 5 GB, sorter/0 weights 1 GB\)'):
    gm.check_fits(shares, 10**10, {0: {'router state': 5 * 10**9, 'sorter/0 weights': 10**9}},
                  {})
  with pytest.raises(ConfigError, match=r'vLLM engine router/0: .*=0\.45 gives it 4\.5 GB .*'
                     r'need 5 GB'):
    gm.check_fits(shares, 10**10, {}, {'router/0': 5 * 10**9})


def _spec(devices, **rollout):
  c = hierarchical_assistant.get_config('runlocal')
  for k, v in rollout.items():
    c.rollout[k] = v
  return build_team_spec(c, build_char_tokenizer().vocab_size, list(range(devices)),
                         build_workflow(c.workflow).agent_names())


@pytest.mark.extra('vllm')  # specs with rollout.backend=vllm check the install
def test_needs_follow_the_placement():
  own = _spec(4)  # fitted: own meshes, instances on them
  held, engines = gm.needs(own)
  state = {n: state_nbytes(a.model, a.optimizer, a.grpo) for n, a in own.agents.items()}
  assert engines == {}
  assert held == {own.placement.train[n].devices[0]: {f'{n} state': state[n]} for n in state}
  pooled = _spec(1)  # fitted: a pool of one mesh; samplers keep their own weights there
  held, _ = gm.needs(pooled)
  weights = {n: param_count(a.model) * 4 for n, a in pooled.agents.items()}
  two = sorted(state, key=lambda n: (-state[n], n))[:2]  # the mesh holds two at once
  assert held[0] == {f'pool0 ({two[0]} + {two[1]} states)': state[two[0]] + state[two[1]],
                     **{f'{n}/0 weights': weights[n] for n in weights}}
  one = dataclasses.replace(pooled, training=dataclasses.replace(pooled.training,
                                                                 states_per_mesh=1))
  held, _ = gm.needs(one)
  assert held[0][f'pool0 ({two[0]} state)'] == state[two[0]]
  shares = gm.plan(0, {})
  need = sum(held[0].values()) + state[two[1]]  # with two states on the pool mesh
  with pytest.raises(ConfigError, match=r'training\.states_per_mesh=1'):
    gm.check_fits(shares, int(need / shares.jax) - 1, *gm.needs(pooled))
  gm.check_fits(shares, int(need / shares.jax) - 1, *gm.needs(one))
  vllm = _spec(1, backend='vllm', vllm={'max_model_len': 64})
  held, engines = gm.needs(vllm)
  m = vllm.agents['router'].model
  assert engines['router/0'] == param_count(m) * 4 + 2 * m.layers * m.kv_heads * m.head_dim * 64 * 4
  assert set(engines) == {f'{n}/0' for n in vllm.agents} and not any(
      'weights' in k for k in held[0])


@pytest.mark.extra('vllm')  # specs with rollout.backend=vllm check the install
def test_settle_sets_the_vllm_share():
  spec = _spec(1, backend='vllm')
  shares = gm.plan(4, {})
  settled = gm.settle(spec, shares, 10**10)
  assert settled.rollout.vllm['gpu_memory_utilization'] == pytest.approx(0.18)
  assert settled.placement == spec.placement
  with pytest.raises(ConfigError, match=r'GPU 0: JAX gets 0\.18 of it \(0\.0018 MB\).*pool0'):
    gm.settle(spec, shares, 10**4)  # a GPU of 10 kB holds nothing
