"""Write a small local Hugging Face checkpoint (nothing can be downloaded here).

  python experiments/make_tiny_hf.py [OUT_DIR]   # default: runs/tiny_hf

A Qwen2-layout decoder (q/k/v biases, tied embeddings) of the tiny size with two
32-wide heads (vLLM's CPU attention needs head sizes >= 32), random weights, and
the built-in character tokenizer with its special tokens. `transformers`, vLLM and
`config.agents.NAME.model.checkpoint` all load it; experiments/pretrained_vllm.py
starts two agents from it.
"""

import sys

from flax import nnx

from flexmarl.models import hf
from flexmarl.models.tokenizer import build_char_tokenizer
from flexmarl.models.transformer import PRESETS, Decoder, ModelConfig


def make(out_dir: str, seed: int = 0) -> str:
  tokenizer = build_char_tokenizer()
  sizes = dict(PRESETS['tiny'], heads=2, kv_heads=1, head_dim=32)
  cfg = ModelConfig(vocab_size=tokenizer.vocab_size, qkv_bias=True, tie_embeddings=True, **sizes)
  params = nnx.to_pure_dict(nnx.state(Decoder(cfg, nnx.Rngs(params=seed))))
  return hf.save_hf(cfg, params, out_dir, tokenizer=tokenizer)


if __name__ == '__main__':
  print('wrote', make(sys.argv[1] if len(sys.argv) > 1 else 'runs/tiny_hf'))
