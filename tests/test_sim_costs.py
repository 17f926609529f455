"""Simulator cost models against values computed by hand."""

import pytest

from experiments.sim import category_assistant, merchant_assistant, scalability
from flexmarl.sim import costs
from flexmarl.sim.specs import ASCEND_910C_DIE, QWEN25_14B, QWEN25_32B, Accelerator, ModelSpec, model

ROUND = Accelerator('round', memory_bytes=64e9, peak_flops=1e15, hbm_bytes_per_s=2e12,
                    network_bytes_per_s=25e9)


def test_parameter_counts_equal_the_published_checkpoints():
  assert QWEN25_14B.params == 14_770_033_664
  assert QWEN25_32B.params == 32_763_876_352
  # A one-layer toy by hand: attention 2*16*16 + 2*16*4 + 16 + 2*4 = 664 (kv = 2 heads x 2);
  # mlp 3*16*32 = 1536; norms 32; embeddings 2*10*16 = 320; final norm 16.
  toy = ModelSpec('toy', layers=1, hidden=16, intermediate=32, heads=8, kv_heads=2, vocab=10)
  assert toy.params == 664 + 1536 + 32 + 320 + 16
  assert QWEN25_14B.kv_bytes_per_token() == 2 * 48 * 8 * 128 * 2  # 196,608 bytes
  with pytest.raises(ValueError, match="model='qwen-7b'.*qwen2.5-14b"):
    model('qwen-7b')


@pytest.mark.quick
def test_generation_time_by_hand():
  rates = costs.DecodeRates(step_s=0.02, token_s=0.001, prefill_token_s=1e-4)
  # 100 decode steps (longest response) * 20 ms + 160 tokens * 1 ms + 300 prompt tokens * 0.1 ms
  assert costs.generation_time([100, 50, 10], 300, rates) == pytest.approx(2.0 + 0.16 + 0.03)
  assert costs.generation_time([], 0, rates) == 0.0
  assert costs.decode_throughput(10, rates) == pytest.approx(10 / 0.03)
  with pytest.raises(ValueError, match='token_s=-1'):
    costs.DecodeRates(0.01, -1, 0)


def test_decode_rates_from_the_accelerator_and_from_measured_throughputs():
  rates = costs.decode_rates(QWEN25_14B, ROUND, tp=2)
  n = 14_770_033_664
  assert rates.step_s == pytest.approx(2 * n / (2 * 2e12 * 0.7))  # bf16 weights / (2 HBMs * 70 %)
  assert rates.token_s == pytest.approx(2 * n / (2 * 1e15 * 0.2))
  assert rates.prefill_token_s == pytest.approx(2 * n / (2 * 1e15 * 0.35))
  # 40 tok/s alone, 2000 tok/s at batch 64: 25 ms/step alone, 32 ms/step at 64 -> 1/9 ms/seq.
  fitted = costs.rates_from_throughput(40.0, 2000.0, 64)
  assert fitted.token_s == pytest.approx((0.032 - 0.025) / 63)
  assert costs.decode_throughput(1, fitted) == pytest.approx(40.0)
  assert costs.decode_throughput(64, fitted) == pytest.approx(2000.0)
  with pytest.raises(ValueError, match='larger batch'):
    costs.rates_from_throughput(100.0, 50.0, 8)


def test_train_swap_and_sync_times_by_hand():
  # 6 * 14.77e9 * 131072 tokens / (16 devices * 1e15 * 0.35)
  assert costs.train_time(QWEN25_14B, 131072, 16, ROUND) == pytest.approx(
      6 * 14_770_033_664 * 131072 / (16 * 1e15 * 0.35))
  assert costs.train_time(QWEN25_14B, 1000, 4, ROUND, mfu=0.5) == pytest.approx(
      6 * 14_770_033_664 * 1000 / 2e15)
  with pytest.raises(ValueError, match='devices=0'):
    costs.train_time(QWEN25_14B, 1000, 0, ROUND)
  assert costs.swap_time(QWEN25_32B) == pytest.approx(11.0)  # the paper's figure, by construction
  assert costs.swap_time(QWEN25_14B) == pytest.approx(11.0 * 14_770_033_664 / 32_763_876_352)
  assert costs.train_state_bytes(QWEN25_32B) == 14 * 32_763_876_352
  # bf16 weights of 14B (29.54 GB) over two 25 GB/s NICs
  assert costs.weight_sync_time(QWEN25_14B, 2, ASCEND_910C_DIE) == pytest.approx(
      2 * 14_770_033_664 / 50e9)
  assert costs.transfer_time(1e9, 1e9, latency_s=0.5) == 1.5


def _setups():
  yield 'merchant', merchant_assistant.get_config()
  yield 'category', category_assistant.get_config()
  for mix in scalability.MIXES:
    yield mix, scalability.get_config(mix)


def test_paper_setups_fit_the_cluster_they_describe():
  models = {}
  for name, c in _setups():
    accel = ASCEND_910C_DIE
    assert c.cluster.rollout_nodes + c.cluster.train_nodes == c.cluster.nodes == 48
    assert c.cluster.devices_per_node == 16 and accel.memory_bytes == 64e9
    assert (c.global_batch, c.micro_batch, c.query_parallelism, c.branch_parallelism,
            c.balance_threshold) == (64, 16, 4, 16, 5)
    for a in c.agents.values():
      m = model(a.model)
      # bf16 weights take at most 60 % of an instance's memory (the rest is KV cache),
      # and the train state (14 bytes/param) fits the training mesh.
      assert costs.param_bytes(m) <= 0.6 * a.rollout_tp * accel.memory_bytes, (name, a.model)
      assert costs.train_state_bytes(m) <= 0.8 * a.train_devices * accel.memory_bytes
      assert c.micro_batch % a.group_size == 0
    assert set(c.workflow.specialists) | {c.workflow.router} == set(c.agents)
    models[name] = sorted(a.model for a in c.agents.values())
  assert models['5x32b'] == ['qwen2.5-32b'] * 5
  assert models['3x32b+7x14b'] == ['qwen2.5-14b'] * 7 + ['qwen2.5-32b'] * 3
  assert models['15x14b'] == ['qwen2.5-14b'] * 15
  # The category team is sized by MAS-RL / MARTI (438.6 / 112.8, ~1.05 per agent on the
  # merchant team): four agents.
  ratio = category_assistant.get_config().paper.step_time_s
  per_agent = 914.4 / 174.1 / len(merchant_assistant.get_config().agents)
  assert models['category'] == ['qwen2.5-14b'] * round(
      ratio.agents_in_turn / ratio.colocated / per_agent) == ['qwen2.5-14b'] * 4
  assert merchant_assistant.get_config().paper.step_time_s.flexmarl == 126.1


def test_fast_char_tokenizer_gives_the_reference_ids_and_text():
  import numpy as np
  from flexmarl.sim.tokenizer import FastCharTokenizer
  from flexmarl.models.tokenizer import DEFAULT_CHARS, build_char_tokenizer
  ref, fast = build_char_tokenizer(), FastCharTokenizer()
  rng = np.random.default_rng(0)
  for n in (0, 1, 7, 300):
    text = ''.join(rng.choice(list(DEFAULT_CHARS), n))
    assert fast.encode(text) == ref.encode(text)
    ids = fast.encode(text)[1:] + [ref.eos_id, 5, ref.pad_id]  # a response: stops at EOS
    assert fast.decode(ids) == ref.decode(ids) == text
    shown = [ref.pad_id, *ids]  # a special token mid-answer is shown, never dropped
    assert fast.decode(np.array(shown)) == ref.decode(shown) == '<pad>' + text
  with pytest.raises(ValueError, match="character 'A'"):
    fast.encode('aA')
