"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`,
written from an agent's adapters and read back into them (what `peft` and vLLM's LoRA
load)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flexmarl.models import hf, lora, transformer
from flexmarl.models.transformer import ModelConfig


def peft_weights(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
  """A LoRA model's adapters under PEFT's names and layouts (lora_A [rank, in],
  lora_B [out, rank], HF's flattening of heads)."""
  r = cfg.lora.rank
  out = {}
  for i in range(cfg.layers):
    for target in cfg.lora.targets:
      group = 'attn' if target in ('q', 'k', 'v', 'o') else 'mlp'
      adapter = params['blocks'][i][group][f'{target}_lora']
      name = f'base_model.model.model.layers.{i}.{lora.TARGETS[target]}'
      out[f'{name}.lora_A.weight'] = np.ascontiguousarray(
          np.asarray(adapter['lora_a']).reshape(-1, r).T)
      out[f'{name}.lora_B.weight'] = np.ascontiguousarray(
          np.asarray(adapter['lora_b']).reshape(r, -1).T)
  return out


def save_peft(cfg: ModelConfig, params: dict, out_dir: str, base_model: str = '') -> str:
  """Write a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) of a
  LoRA model; `base_model`: the base folder it applies to (written into the config)."""
  from safetensors.numpy import save_file
  if not cfg.lora.rank:
    raise ValueError('this model has no adapters (lora.rank 0): export it with save_hf.')
  os.makedirs(out_dir, exist_ok=True)
  save_file(peft_weights(cfg, params), os.path.join(out_dir, 'adapter_model.safetensors'),
            metadata={'format': 'pt'})
  config = dict(peft_type='LORA', task_type='CAUSAL_LM', base_model_name_or_path=base_model,
                r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0, bias='none',
                fan_in_fan_out=False, inference_mode=True,
                target_modules=sorted(lora.TARGETS[t].split('.')[-1] for t in cfg.lora.targets))
  with open(os.path.join(out_dir, 'adapter_config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=2)
  return out_dir


def peft_lora_config(folder: str) -> lora.LoRAConfig:
  """The rank, alpha and targets of a PEFT LoRA adapter folder (its adapter_config.json)."""
  path = os.path.join(folder, 'adapter_config.json')
  if not os.path.isfile(path) or not os.path.isfile(
      os.path.join(folder, 'adapter_model.safetensors')):
    raise FileNotFoundError('give a PEFT adapter folder holding adapter_config.json and '
                            'adapter_model.safetensors (e.g. `flexmarl.export`\'s OUT_DIR/adapter).')
  with open(path, encoding='utf-8') as f:
    config = json.load(f)
  if config.get('peft_type', 'LORA') != 'LORA':
    raise ValueError(f'peft_type {config["peft_type"]!r} is not LORA.')
  by_module = {name.split('.')[-1]: t for t, name in lora.TARGETS.items()}
  modules = config['target_modules']
  unknown = [m for m in modules if m not in by_module]
  if unknown:
    raise ValueError(f'target_modules {unknown} are not among {sorted(by_module)}.')
  targets = tuple(t for t in lora.TARGETS if lora.TARGETS[t].split('.')[-1] in modules)
  return lora.LoRAConfig(int(config['r']), float(config['lora_alpha']), targets)


def load_peft(folder: str, cfg: ModelConfig) -> dict:
  """A PEFT adapter folder's adapters as this model's adapter leaves (host arrays, the
  layout `peft_weights` writes, inverted); refused when a tensor is missing or its
  shape does not fit `cfg`."""
  from safetensors.numpy import load_file
  tensors = load_file(os.path.join(folder, 'adapter_model.safetensors'))
  shapes = lora.partition(nnx.to_pure_dict(transformer.abstract_model(cfg)[1]), cfg.lora)[0]
  r, dtype = cfg.lora.rank, jnp.dtype(cfg.dtype)
  out: dict = {}
  for i in range(cfg.layers):
    for target in cfg.lora.targets:
      group = 'attn' if target in ('q', 'k', 'v', 'o') else 'mlp'
      like = shapes['blocks'][i][group][f'{target}_lora']
      name = f'base_model.model.model.layers.{i}.{lora.TARGETS[target]}'
      a, b = tensors.get(f'{name}.lora_A.weight'), tensors.get(f'{name}.lora_B.weight')
      if a is None or b is None or a.size != like['lora_a'].size or b.size != like['lora_b'].size:
        raise ValueError(f'model.adapter={folder!r}: the tensors of {name} are missing or do '
                         f'not fit rank {r}; the adapter was made for another model or rank.')
      hf.set_leaf(out, ('blocks', i, group, f'{target}_lora', 'lora_a'),
           np.ascontiguousarray(a.T).reshape(like['lora_a'].shape).astype(dtype))
      hf.set_leaf(out, ('blocks', i, group, f'{target}_lora', 'lora_b'),
           np.ascontiguousarray(b.T).reshape(like['lora_b'].shape).astype(dtype))
  return out
