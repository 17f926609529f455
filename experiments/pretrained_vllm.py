"""Two agents that start from a local HF checkpoint and roll out through vLLM.

  python experiments/make_tiny_hf.py runs/tiny_hf          # the checkpoint
  python -m flexmarl.main --config=experiments/pretrained_vllm.py --workdir=runs/pv
  python -m flexmarl.export runs/pv solver runs/pv_solver_hf   # back out as HF

Needs the vLLM extra (requirements-vllm.txt). `--config=...:CHECKPOINT_DIR` points
both agents (and the tokenizer) at another folder.
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  checkpoint = arg or 'runs/tiny_hf'
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 5
  config.schedule = 'flexmarl'
  config.tokenizer = checkpoint  # the checkpoint's own tokenizer and special tokens
  config.max_prompt_len = 10
  config.checkpoint_every = 5
  config.cluster = cluster_config()  # backend=ray: docs/cluster.md
  config.workflow = dict(name='solver_verifier', solver='solver', verifier='verifier',
                         family='add', task_args={'max_operand': 4})
  config.rollout = dict(
      query_concurrency=8, max_step_queries=32, devices='shared', backend='vllm',
      # On a GPU, gpu_memory_utilization is left to flexmarl.runtime.gpu_memory (shared with JAX).
      vllm=dict(dtype='float32', max_model_len=64, kv_cache_bytes=64 << 20,
                enforce_eager=True))
  sampling = dict(temperature=1.0, top_p=1.0, max_new_tokens=2)  # vLLM: top_p must be 1
  config.agents = dict(
      solver=agent_config('tiny', group_size=8, global_batch=64, micro_batch=32,
                          sampling=sampling),
      verifier=agent_config('tiny', group_size=2, global_batch=128, micro_batch=32,
                            sampling=sampling),
  )
  for agent in config.agents.values():
    agent.model.checkpoint = checkpoint
  return config
