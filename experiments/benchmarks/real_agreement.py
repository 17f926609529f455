"""Train as you serve, on a real model: exported agents answer the held-out problems in
transformers and vLLM as the framework's own greedy evaluation answered them.

  python experiments/benchmarks/real_agreement.py --config=experiments/real_team.py \
      --workdir=runs/real_team [--vllm]

For a run's newest checkpoint: the framework's held-out evaluation (greedy, pass@1,
answers kept); then every agent exported (`flexmarl.export`: a merged HF folder, and for
a LoRA agent its PEFT adapter), and the same workflow run on the same held-out problems
with each agent answered by
- transformers, the merged folder, prompts through the exported tokenizer's own
  `apply_chat_template`, greedy, stopping at the exported generation_config's ids;
- transformers, the base model (the GGUF file, transformers' own import) plus the PEFT
  adapter (`peft.PeftModel`), the same way;
- vLLM (`--vllm`; CPU build), the merged folder, the same prompts, temperature 0.
Prints, per agent and way, the held-out accuracy against the framework's and the share of
identical answers (the bar: within ±0.02, ≥ 98% identical). Needs the vLLM/HF extras.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'The run\'s experiment config.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'The run folder (its newest checkpoint).')
_VLLM = flags.DEFINE_bool('vllm', False, 'Also answer through vLLM.')
_OUT = flags.DEFINE_string('out', '', 'Write the figures here as JSON.')


class _Answerer:
  """An agent of the workflow answered by `answer(messages, max_new_tokens) -> text`,
  one greedy answer per call (pass@1, as the framework's evaluation)."""

  def __init__(self, name, answer, max_new_tokens, log):
    self.name, self.answer, self.max_new_tokens, self.log = name, answer, max_new_tokens, log

  async def generate(self, prompt, n=None, *, max_new_tokens=None, stop=()):
    from flexmarl.workflows.base import Completion
    del n, stop
    text = self.answer(prompt, max_new_tokens or self.max_new_tokens)
    query_id = self.log['query']
    self.log['texts'][(query_id, self.name)] = text
    self.log['agent_of'][f'{query_id}_{self.name}'] = self.name
    return [Completion(f'{query_id}_{self.name}', self.name, text, 0)]


def _run_workflow(workflow, answerers: dict, max_new_tokens: dict) -> tuple[dict, dict]:
  """Run the held-out queries with `answerers` (agent → answer fn): (texts, accuracy)."""
  log = {'texts': {}, 'query': '', 'agent_of': {}}
  right: dict[str, list[bool]] = {}
  for query in workflow.eval_queries():
    log['query'] = query.query_id
    agents = {n: _Answerer(n, answerers[n], max_new_tokens[n], log) for n in answerers}
    episode = asyncio.run(workflow.run(query, agents))
    for sid, ok in episode.correct.items():
      right.setdefault(log['agent_of'][sid], []).append(ok)
  return log['texts'], {a: sum(v) / len(v) for a, v in right.items()}


def _hf_answer(model, tokenizer):
  import torch

  def answer(messages, max_new_tokens):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                        return_tensors='pt', return_dict=True)
    with torch.no_grad():
      out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids['input_ids'].shape[1]:], skip_special_tokens=True)
  return answer


def main(argv) -> None:
  del argv
  sys.path.insert(0, os.getcwd())
  from flexmarl import run
  from flexmarl.export import export
  from flexmarl.rollout.held_out import answer_texts, eval_lines, run_held_out
  config, workdir = _CONFIG.value, _WORKDIR.value
  orchestrator = run.build(config, workdir)
  try:
    step = orchestrator.restore()
    results = run_held_out(orchestrator.rollout_engine, orchestrator.workflow)
    ours = answer_texts(results, orchestrator.rollout_engine.tokenizers)
    lines = eval_lines(results)
    workflow = orchestrator.workflow
    limits = {n: s.max_new_tokens for n, s in orchestrator.rollout_engine.sampling.items()}
  finally:
    orchestrator.close()
  print(f'framework, step {step}: ' + ', '.join(
      f"{a} {l['eval_accuracy']:.3f}" for a, l in lines.items()))
  import torch
  import transformers
  torch.set_num_threads(os.cpu_count() or 1)
  folders = {a: export(workdir, a, os.path.join(workdir, 'export', a)) for a in limits}
  ways: dict[str, dict] = {}
  merged = {a: _hf_answer(transformers.AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32),
                          transformers.AutoTokenizer.from_pretrained(f))
            for a, f in folders.items()}
  ways['transformers (merged)'] = merged
  if all(os.path.isdir(os.path.join(f, 'adapter')) for f in folders.values()):
    import peft
    from flexmarl.models import source
    adapters = {}
    for a, f in folders.items():  # each agent on its own checkpoint (a team may mix families)
      checkpoint = config.agents[a].model.checkpoint
      local = source.local(checkpoint)
      folder, name = os.path.split(local) if source.kind(checkpoint) == source.GGUF else (
          local, None)
      base = transformers.AutoModelForCausalLM.from_pretrained(
          folder, gguf_file=name, dtype=torch.float32)
      adapters[a] = _hf_answer(peft.PeftModel.from_pretrained(base, os.path.join(f, 'adapter')),
                               transformers.AutoTokenizer.from_pretrained(f))
    ways['transformers (base + PEFT adapter)'] = adapters
  if _VLLM.value:
    os.environ.setdefault('VLLM_ENABLE_V1_MULTIPROCESSING', '0')
    import vllm
    engines = {}
    for a, f in folders.items():
      llm = vllm.LLM(model=f, dtype='float32', enforce_eager=True, max_model_len=512,
                     kv_cache_memory_bytes=256 << 20)
      tok = transformers.AutoTokenizer.from_pretrained(f)

      def answer(messages, max_new_tokens, llm=llm, tok=tok):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)['input_ids']
        out = llm.generate([vllm.TokensPrompt(prompt_token_ids=ids)],
                           vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens),
                           use_tqdm=False)
        return out[0].outputs[0].text
      engines[a] = answer
    ways['vLLM (merged)'] = engines
  report = {'step': step, 'framework': {a: l['eval_accuracy'] for a, l in lines.items()}}
  for way, answerers in ways.items():
    texts, accuracy = _run_workflow(workflow, answerers, limits)
    same = {a: sum(texts.get(k) == v for k, v in ours.items() if k[1] == a)
            / max(1, sum(k[1] == a for k in ours)) for a in limits}
    report[way] = {'accuracy': accuracy, 'identical': same}
    print(f'{way}: ' + ', '.join(
        f'{a} acc {accuracy.get(a, float("nan")):.3f} (framework '
        f'{lines[a]["eval_accuracy"]:.3f}), identical {same[a]:.1%}' for a in limits))
  if _OUT.value:
    with open(_OUT.value, 'w', encoding='utf-8') as f:
      json.dump(report, f, indent=2, default=str)


if __name__ == '__main__':
  app.run(main)
