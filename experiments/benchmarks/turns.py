"""Teams in turns against one agent, and the credit modes side by side, held out.

  python experiments/benchmarks/turns.py --variant=toy --root=runs/turns      # minutes
  python experiments/benchmarks/turns.py --root=runs/turns_real               # SmolLM2

On `experiments/rounds_team.py` (a solver and a checker in rounds), each row's held-out
team accuracy (greedy; a problem counts when its attempt's last answer is right):
- base alone: one policy answering once (`rounds=1`), untrained;
- team untrained: the rounds workflow, untrained (`flexmarl.evaluate --base`);
- single trained: one policy taking every turn (`:single`), trained;
- team trained (credit by episode), AT-GRPO (`:at_grpo`) and Dr. MAS (`:drmas`), trained.
Each run is `python -m flexmarl.main` (or `flexmarl.evaluate`) in a process of its own;
`--steps` overrides the experiment's. Prints the table and writes ROOT/turns.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app, flags

_ROOT = flags.DEFINE_string('root', 'runs/turns', 'Folder for the runs and turns.json.')
_VARIANT = flags.DEFINE_string('variant', '', "Extra variant of every run, e.g. 'toy'.")
_STEPS = flags.DEFINE_integer('steps', 0, "Training steps (0: the experiment's own).")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TRAINED = (('single trained', 'single'), ('team trained (episode)', ''),
           ('AT-GRPO (branch 4, call)', 'at_grpo'), ('Dr. MAS (episode_agent)', 'drmas'))


def _config(variant: str) -> str:
  variants = ','.join(v for v in (variant, _VARIANT.value) if v)
  return '--config=experiments/rounds_team.py' + (f':{variants}' if variants else '')


def _run(args: list[str], log: str) -> None:
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8')
  with open(log, 'w', encoding='utf-8') as out:
    code = subprocess.call([sys.executable, '-m', *args], cwd=REPO, env=env, stdout=out,
                           stderr=subprocess.STDOUT)
  if code:
    raise RuntimeError(f'{" ".join(args)} failed ({code}); see {log}')


def _evaluate(name: str, variant: str, extra: list[str]) -> float:
  out = os.path.join(_ROOT.value, f'{name}.json')
  _run(['flexmarl.evaluate', _config(variant), '--base', f'--out={os.path.abspath(out)}',
        *extra], out + '.log')
  with open(out, encoding='utf-8') as f:
    return json.load(f)['team']['eval_accuracy']


def _train(name: str, variant: str) -> tuple[float, float]:
  workdir = os.path.abspath(os.path.join(_ROOT.value, name))
  steps = [f'--config.steps={_STEPS.value}'] if _STEPS.value else []
  _run(['flexmarl.main', _config(variant), f'--workdir={workdir}', *steps],
       workdir + '.log')
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    evals = [l for l in map(json.loads, f) if l.get('agent') == 'team' and 'eval_accuracy' in l]
  return evals[0]['eval_accuracy'], evals[-1]['eval_accuracy']


def main(argv) -> None:
  del argv
  os.makedirs(_ROOT.value, exist_ok=True)
  table = {'base alone (one answer)': _evaluate('base_alone', 'single',
                                                ['--config.workflow.rounds=1']),
           'team untrained': _evaluate('team_untrained', '', [])}
  for name, variant in TRAINED:
    table[name] = _train(name.split(' (')[0].replace(' ', '_'), variant)[1]
  with open(os.path.join(_ROOT.value, 'turns.json'), 'w', encoding='utf-8') as f:
    json.dump(table, f, indent=2)
  for name, accuracy in table.items():
    print(f'{name:28s} {accuracy:.2f}')


if __name__ == '__main__':
  app.run(main)
