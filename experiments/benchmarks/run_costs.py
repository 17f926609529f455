"""Where a finished run's time went, per agent, from its own trace and metrics.

  python experiments/benchmarks/run_costs.py WORKDIR [--skip=2] [--until=0]

Reads `WORKDIR/trace.json` (spans) and `metrics.jsonl`; leaves out the first `--skip` steps
(their compiles) and, with `--until=N`, the steps after N (say, a stretch that shared the
machine). Prints, per rollout instance (`generate` spans: one line per agent, or per
adapter group such as `sum+product`), the tokens generated, the time generating and their
ratio; per agent (`micro_batch` spans), the response tokens trained, the time in micro-batches and
their ratio; and the median step, rollout and training time of the team's metrics lines.
"""

from __future__ import annotations

import collections
import json
import os
import statistics

from absl import app, flags

_SKIP = flags.DEFINE_integer('skip', 2, 'Leave out the first steps (their compiles).')
_UNTIL = flags.DEFINE_integer('until', 0, 'Leave out the steps after this one (0: none).')


def _counted(step: int) -> bool:
  return step > _SKIP.value and (not _UNTIL.value or step <= _UNTIL.value)


def spans(workdir: str) -> dict[str, dict[str, list[float]]]:
  """kind ('generate', 'micro_batch') → key (agent or adapter group) → [tokens, seconds]."""
  with open(os.path.join(workdir, 'trace.json'), encoding='utf-8') as f:
    trace = json.load(f)
  out: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0.0]))
  for e in trace['traceEvents'] if isinstance(trace, dict) else trace:
    args = e.get('args', {})
    if e.get('ph') != 'X' or e.get('cat') not in ('generate', 'micro_batch') or \
        not _counted(args.get('step', 0)):
      continue
    totals = out[e['cat']]['+'.join(sorted(args['agent'].split('+')))]  # a group, any order
    totals[0] += args.get('tokens', 0)
    totals[1] += e['dur'] / 1e6
  return out


def main(argv) -> None:
  workdir = argv[1]
  for kind, by_key in spans(workdir).items():
    for key, (tokens, seconds) in sorted(by_key.items()):
      print(f'{kind:12s} {key:16s} {int(tokens):7d} tokens in {seconds:8.1f} s: '
            f'{tokens / max(seconds, 1e-9):6.1f} tokens/s')
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    team = [l for l in map(json.loads, f) if l.get('agent') == 'team' and 'rollout_s' in l
            and _counted(l['step'])]
  if team:
    print('median over {} steps: step {:.1f} s, rollout {:.1f} s, training {:.1f} s'.format(
        len(team), *(statistics.median(l[k] for l in team)
                       for k in ('step_time_s', 'rollout_s', 'train_s'))))


if __name__ == '__main__':
  app.run(main)
