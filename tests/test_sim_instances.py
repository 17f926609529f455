"""SimSampler: queued batches finish at hand-computed simulated times; lengths come from row keys."""

import numpy as np
import pytest

from flexmarl.core.clock import SimClock
from flexmarl.metrics import spans as sp
from flexmarl.metrics.spans import SpanRecorder
from flexmarl.rollout.sampler import SamplingParams, sample_key
from flexmarl.sim.costs import DecodeRates
from flexmarl.sim.instances import SimSampler, response_lengths

RATES = DecodeRates(step_s=0.01, token_s=0.001, prefill_token_s=0.0005)


def _keys(n, version=0):
  return np.stack([sample_key(0, 'a', version, f'q{i}') for i in range(n)])


@pytest.mark.quick
def test_batches_queue_on_the_instance_and_finish_at_the_computed_times():
  clock = SimClock()
  rec = SpanRecorder(clock)
  s = SimSampler(clock, RATES, dict(median=50, sigma=0.0, max=100), sync_s=0.5, agent='a',
                 recorder=rec, track='rollout:a/0')
  params = SamplingParams(max_new_tokens=8)  # caps every length at 8
  first = s.submit([[1, 2]] * 4, _keys(4), params)  # 8 steps * 10 ms + 32 tok * 1 ms + 8 * 0.5 ms
  second = s.submit([[1]] * 2, _keys(2), params)    # queued: 80 + 16 + 1 ms after the first
  s.update_weights(None, 1)
  third = s.submit([[1]], _keys(1, 1), params)      # after the sync: 80 + 8 + 0.5 ms
  assert first.finish_time == pytest.approx(0.116)
  assert second.finish_time == pytest.approx(0.116 + 0.097)
  assert third.start_time == pytest.approx(0.213 + 0.5) and third.version == 1
  assert third.finish_time == pytest.approx(0.713 + 0.0885)
  assert clock.wait_any([third, second, first]) == [first] and clock.now() == pytest.approx(0.116)
  batch = second.result()
  assert clock.now() == pytest.approx(0.213)
  assert batch.tokens.shape == (2, 8) and batch.tokens.dtype == np.int32
  assert batch.logprobs.dtype == np.float32 and list(batch.lengths) == [8, 8]
  names = [(x.name, x.args.get('version'), x.args.get('tokens')) for x in rec.spans()]
  assert names == [(sp.GENERATE, 0, 32), (sp.GENERATE, 0, 16), (sp.WEIGHT_SYNC, 1, None),
                   (sp.GENERATE, 1, 8)]


def test_a_rows_length_depends_on_its_key_only():
  keys = _keys(64)
  lengths = response_lengths(keys, median=100, sigma=0.6, max_tokens=1000)
  assert lengths.min() >= 1 and len(set(lengths.tolist())) > 20
  assert 60 < np.median(lengths) < 160  # lognormal around its median
  assert (response_lengths(keys[10:20], 100, 0.6, 1000) == lengths[10:20]).all()
  assert response_lengths(keys, 100, 3.0, 150).max() == 150
  clock = SimClock()
  s = SimSampler(clock, RATES, dict(median=20, sigma=0.6, max=64))
  out = s.submit([[1]] * 4, keys[:4], SamplingParams(max_new_tokens=64)).result()
  assert list(out.lengths) == list(response_lengths(keys[:4], 20, 0.6, 64))
  for row, n in zip(out.tokens, out.lengths):
    assert (row[:n] >= 3).all() and (row[n:] == 0).all()


def test_bad_input_is_refused():
  clock = SimClock()
  with pytest.raises(ValueError, match="lacks \\['max'\\]"):
    SimSampler(clock, RATES, dict(median=20, sigma=0.6))
  with pytest.raises(ValueError, match='needs a track'):
    SimSampler(clock, RATES, dict(median=20, sigma=0.6, max=64), recorder=SpanRecorder(clock))
  s = SimSampler(clock, RATES, dict(median=20, sigma=0.6, max=64))
  with pytest.raises(ValueError, match=r'\(3, 2\)'):
    s.submit([[1]] * 3, _keys(2), SamplingParams())
  s.close()
  with pytest.raises(RuntimeError, match='closed'):
    s.submit([[1]], _keys(1), SamplingParams())
