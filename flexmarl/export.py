"""Export an agent's latest checkpoint as a Hugging Face folder.

  python -m flexmarl.export WORKDIR AGENT OUT_DIR [--step=N] [--dtype=bfloat16]

The folder (safetensors, config.json, tokenizer files) loads in `transformers`
(`AutoModelForCausalLM.from_pretrained`) and in vLLM, and as `model.checkpoint` of a
new FlexMARL agent. A LoRA agent is written with its adapters merged into the weights
(base + scale·A·B), and its adapters alone as a PEFT folder in `OUT_DIR/adapter`; its
checkpoints hold the adapters, and its base is rebuilt as the run made it (its
`model.checkpoint`, or the random initialisation of its seed). The agent's
architecture is rebuilt from `WORKDIR/config.json`
and its tokenizer from `WORKDIR/tokenizers/AGENT/` (an agent's own) or
`WORKDIR/tokenizer/` (the team's), written when the run started.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import ml_collections
from absl import app, flags
from flax import nnx

from flexmarl.config import agent_spec
from flexmarl.core.errors import ConfigError
from flexmarl.models import hf, lora, peft, transformer
from flexmarl.models.tokenizer import load_tokenizer
from flexmarl.run import quiet_logging
from flexmarl.runtime.workdir import WorkdirError
from flexmarl.train import shared_base
from flexmarl.train.checkpoint import AgentCheckpointer, saved_steps
from flexmarl.train.optimizer import make_optimizer

_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
_DTYPE = flags.DEFINE_string('dtype', None, 'Cast the weights, e.g. bfloat16 (default: as trained).')


def export(workdir: str, agent: str, out_dir: str, step: int | None = None,
           dtype: str | None = None) -> str:
  """Write `agent`'s checkpoint `step` (default: latest) of the run in `workdir`."""
  config = _run_config(workdir, agent, step, dtype)
  own = os.path.join(workdir, 'tokenizers', agent)  # the agent's own, if it had one
  tokenizer = load_tokenizer(own if os.path.isdir(own) else os.path.join(workdir, 'tokenizer'))
  spec = agent_spec(config, agent, tokenizer.vocab_size)
  checkpointer = AgentCheckpointer(workdir, agent)
  steps = checkpointer.steps()
  # Restore onto one device, as shapes first: nothing is initialised just to be replaced.
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  trainable, frozen = lora.partition(nnx.to_pure_dict(transformer.abstract_model(spec.model)[1]),
                                     spec.model.lora)
  like = {'params': trainable,  # a LoRA agent's adapters; else the whole model
          'opt_state': jax.eval_shape(make_optimizer(spec.optimizer).init, trainable)}
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), like)
  state, _ = checkpointer.restore(max(steps) if step is None else step, like)
  checkpointer.close()
  params = state['params']
  if spec.model.lora.rank:  # the checkpoint holds adapters: the base is rebuilt as the run did
    peft.save_peft(spec.model, params, os.path.join(out_dir, 'adapter'),
                 base_model=spec.checkpoint)
    base = shared_base.load_base(spec.model, spec.checkpoint, spec.random_base_seed)(
        jax.tree.map(lambda _: device, frozen))
    params = lora.combine(params, base)
  return hf.save_hf(spec.model, params, out_dir, tokenizer=tokenizer, dtype=dtype)


def _run_config(workdir: str, agent: str, step: int | None, dtype: str | None
                ) -> ml_collections.ConfigDict:
  """The run's config, once the arguments are checked against it: before any work, and
  before anything is written."""
  config_file = os.path.join(workdir, 'config.json')
  if not os.path.isfile(config_file):
    raise WorkdirError(f'WORKDIR={workdir!r} holds no run (no config.json): give the '
                       'workdir of a flexmarl.main run.')
  with open(config_file, encoding='utf-8') as f:
    config = ml_collections.ConfigDict(json.load(f))
  if agent not in config.get('agents', {}):
    raise ConfigError(f'AGENT={agent!r}: the run in {workdir!r} has no agent {agent!r}; give '
                      f'one of its config.agents: {sorted(config.get("agents", {}))}.')
  steps = saved_steps(workdir, agent)
  if not steps:
    raise WorkdirError(f'AGENT={agent!r}: the run in {workdir!r} has no checkpoint of it yet; '
                       'train it until a step that checkpoint_every saves, then export.')
  if step is not None and step not in steps:
    raise WorkdirError(f'--step={step}: agent {agent!r} in {workdir!r} has checkpoints of '
                       f'steps {steps}; give one of them, or leave --step out (the latest).')
  if dtype is not None:
    try:
      jax.numpy.dtype(dtype)
    except TypeError:
      raise ConfigError(f'--dtype={dtype!r} is not a dtype; give e.g. bfloat16 or float32, '
                        'or leave it out (as trained).') from None
  return config


def main(argv):
  quiet_logging()  # Orbax logs every restore step at INFO; warnings still show
  if len(argv) != 4:
    raise app.UsageError('usage: python -m flexmarl.export WORKDIR AGENT OUT_DIR')
  try:
    out = export(argv[1], argv[2], argv[3], step=_STEP.value, dtype=_DTYPE.value)
  except (ConfigError, WorkdirError) as e:  # the message names the argument and the fix
    sys.exit(f'{type(e).__name__}: {e}')
  print(f'wrote {out}')


if __name__ == '__main__':
  app.run(main)
