"""Rollout backends are entries of one registry (flexmarl.rollout.backends): a backend
registered here, with no edit anywhere else, is a value of `rollout.backend` that the
config checks and a real run samples from."""

import ml_collections
import numpy as np
import pytest

from flexmarl.config import ConfigError, team_spec
from flexmarl.models.tokenizer import build_char_tokenizer
from flexmarl.rollout import backends
from flexmarl.rollout.sampler import PendingSamples, Sampler, SamplingParams
from flexmarl.run import train

import test_bad_input as bad_input


class Counted:
  """A sampler that hands every call to another one (an embedded sampler: the trainer
  checks the served logprobs against its own) and records the rows of each generate."""

  def __init__(self, inner: Sampler, calls: list[int]):
    self.inner, self.calls = inner, calls

  @property
  def version(self) -> int:
    return self.inner.version

  def submit(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
             limits: np.ndarray | None = None) -> PendingSamples:
    self.calls.append(len(prompts))
    return self.inner.submit(prompts, keys, params, limits)

  def update_weights(self, state: dict, version: int) -> None:
    self.inner.update_weights(state, version)

  def serve(self, model_cfg, params, version, **tokens) -> bool:
    return self.inner.serve(model_cfg, params, version, **tokens)

  def close(self) -> None:
    self.inner.close()


class Fake(backends.Backend):
  """A backend registered by this file alone: the embedded entry's samplers, counted."""

  name = 'fake'

  def __init__(self):
    self.calls: list[int] = []  # the rows of each generate call

  def sampler(self, local, name, trainer):
    make = backends.get('embedded').sampler(local, name, trainer)
    return lambda devices, weights: Counted(make(devices, weights), self.calls)


@pytest.fixture
def fake(monkeypatch):
  monkeypatch.setattr(backends, 'REGISTRY', dict(backends.REGISTRY))
  return backends.register(Fake())


def small_config(steps: int = 2) -> ml_collections.ConfigDict:
  """One agent answering sums on the fake backend."""
  c = bad_input.small_config(steps)
  c.rollout.backend = 'fake'
  return c


def _spec(c):
  return team_spec(c, build_char_tokenizer().vocab_size, ['solver'])


@pytest.mark.quick
def test_the_config_checks_rollout_backend_against_the_registry(fake):
  """A registered backend is a value of `rollout.backend`; an unknown one is refused
  with the registered names; adapter groups only on a backend that serves them."""
  assert _spec(small_config()).rollout.backend == 'fake'
  c = small_config()
  c.rollout.backend = 'sglang'
  with pytest.raises(ConfigError, match=r"rollout\.backend='sglang'.*'embedded', 'vllm', 'fake'"):
    _spec(c)
  c = small_config()
  c.rollout.adapter_groups = [['solver', 'other']]
  with pytest.raises(ConfigError, match="rollout.backend='fake' gives every agent instances"):
    _spec(c)


def test_a_registered_backend_serves_a_real_run(fake, tmp_path):
  """`flexmarl.run.train` with rollout.backend='fake': every sample comes through the
  fake backend's samplers, and the agent trains on them."""
  summary = train(small_config(), str(tmp_path), log=lambda *_: None)
  assert fake.calls and sum(fake.calls) >= 2 * 8  # two steps of a global batch of 8 rows
  assert summary['steps'] == 2
  assert summary['agents']['solver']['updates'] > 0, summary
