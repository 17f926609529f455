"""Every paper setup under every variant in the simulator, next to the paper's figures,
and where FlexMARL's gain comes from.

  python experiments/benchmarks/cluster_sim.py [--setups=merchant,category] [--steps=8]
      [--gain_map=gain_map.png] [--pool_sweep=2,3,4]

Prints per setup: each variant's mean step time (after the warm-up step), the paper's
figure and the relative error, the rollout time, the critical-path bound, the
utilization of the rollout and training pools (simulated seconds), queries per step,
instance moves, FlexMARL's speed-up over each baseline, and the real seconds the setup
took. The merchant assistant's figures are the ones the workload was fitted on
(experiments/sim/paper.py, FIT); the category assistant's are predicted with the same
parameters; the scalability mixes have no published step times (and skip `agents_in_turn`, a rollout
per agent per step, unless --mix_turns). Then the assumptions (every workload parameter
and its source).

With --gain_map, draws FlexMARL's gain over the colocated baseline (MARTI) on the
merchant workload against the ratio of training to rollout time (training made costlier
or cheaper than fitted) and against the load skew (the Zipf exponent over the
specialists), as a PNG.

With --pool_sweep, runs the merchant workload's FlexMARL and its no-pipeline ablation
on fewer training meshes than agents (MARTI, colocated, has no training pool), with
swaps that block the orchestrator (as this framework's do) and overlapped ones (the
paper's): whether a shared training pool explains the paper's no-pipeline figure.
"""

from __future__ import annotations

import os
import sys
import time

# Run as a file, the repository root is not on the path; the setups live under it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import matplotlib  # pylint: disable=g-import-not-at-top

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
from absl import app, flags  # pylint: disable=g-import-not-at-top

from experiments.sim import category_assistant, merchant_assistant, paper, scalability  # pylint: disable=g-import-not-at-top
from flexmarl.sim.run import VARIANTS, format_results, simulate  # pylint: disable=g-import-not-at-top

SETUPS = {
    'merchant': (merchant_assistant.get_config, 'fitted'),
    'category': (category_assistant.get_config, 'predicted, not refitted'),
    '5x32b': (lambda: scalability.get_config('5x32b'), 'no published step time'),
    '3x32b+7x14b': (lambda: scalability.get_config('3x32b+7x14b'), 'no published step time'),
    '15x14b': (lambda: scalability.get_config('15x14b'), 'no published step time'),
}
# The gain map's grid: training cost as a multiple of the fitted one, and Zipf exponents.
TRAIN_COST = (0.25, 0.5, 1.0, 2.0, 4.0)
SKEW = (0.0, 0.5, 1.0, 1.5, 2.0)

_SETUPS = flags.DEFINE_list('setups', list(SETUPS), f'Any of {list(SETUPS)}.')
_SCHEDULES = flags.DEFINE_list('schedules', list(paper.SCHEDULES), f'Any of {list(VARIANTS)}.')
_STEPS = flags.DEFINE_integer('steps', 8, 'Simulated steps per variant of the merchant and '
                              'category setups (the first is warm-up: it compiles).')
_MIX_STEPS = flags.DEFINE_integer('mix_steps', 3, 'Simulated steps per variant of a '
                                  'scalability mix.')
_MIX_TURNS = flags.DEFINE_bool('mix_turns', False, 'Also run agents_in_turn on the mixes.')
_TURN_STEPS = flags.DEFINE_integer('turn_steps', 3, 'Simulated steps of agents_in_turn (each '
                                   'is one rollout and update per agent).')
_GAIN_MAP = flags.DEFINE_string('gain_map', None, 'Draw the gain map into this PNG.')
_MAP_STEPS = flags.DEFINE_integer('map_steps', 5, 'Simulated steps per gain-map point.')
_POOL_SWEEP = flags.DEFINE_list('pool_sweep', [], 'Training meshes (fewer than agents) to '
                                'try on the merchant workload.')


def run_setup(name: str) -> None:
  make, role = SETUPS[name]
  mix = name not in ('merchant', 'category')
  steps = _MIX_STEPS.value if mix else _STEPS.value
  variants = [v for v in _SCHEDULES.value
              if not (mix and v == 'agents_in_turn' and not _MIX_TURNS.value)]
  t0 = time.perf_counter()
  results = []
  for variant in variants:
    setup = make()
    setup.steps = _TURN_STEPS.value if variant == 'agents_in_turn' else steps
    results.append(simulate(setup, variant))
  setup = make()
  print(f'\n## {name} ({role}): {len(setup.agents)} agents, {steps} steps '
        f'({_TURN_STEPS.value} of agents_in_turn), the first left out, '
        f'{setup.query_concurrency} queries in flight, {setup.training_meshes} training '
        f'meshes (simulated in {time.perf_counter() - t0:.1f}s)')
  print(format_results(results, dict(setup.paper.step_time_s)))
  print('real seconds per variant: ' + ', '.join(f'{r.variant} {r.wall_s:.1f}' for r in results))


def gain_point(cost: float, skew: float) -> tuple[float, float]:
  """FlexMARL's gain over the colocated baseline, and that baseline's ratio of training
  to rollout time, on the merchant workload with training `cost` x the fitted one and
  Zipf exponent `skew`."""
  steps = {}
  for variant in ('flexmarl', 'colocated'):
    setup = merchant_assistant.get_config()
    setup.steps, setup.warmup_steps = _MAP_STEPS.value, 0
    setup.compile_s = dict(train=0.0, rollout=0.0)
    setup.train_mfu = setup.train_mfu / cost
    setup.workflow.zipf = skew
    steps[variant] = simulate(setup, variant)
  base = steps['colocated']
  return base.step_s / steps['flexmarl'].step_s, (base.step_s - base.rollout_s) / base.rollout_s


def draw_gain_map(path: str) -> None:
  t0 = time.perf_counter()
  points = {(c, s): gain_point(c, s) for c in TRAIN_COST for s in SKEW}
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
  for s in SKEW:
    ratio = [points[c, s][1] for c in TRAIN_COST]
    left.plot(ratio, [points[c, s][0] for c in TRAIN_COST], 'o-', label=f'Zipf {s}')
  left.set_xscale('log')
  left.set_xticks([0.2, 0.5, 1, 2], ['0.2', '0.5', '1', '2'])
  left.minorticks_off()
  left.set(xlabel='training / rollout time of the colocated baseline',
           ylabel='FlexMARL speed-up over colocated (MARTI)',
           title='gain vs training-to-rollout ratio')
  for c in TRAIN_COST:
    right.plot(SKEW, [points[c, s][0] for s in SKEW], 'o-', label=f'training x{c}')
  right.set(xlabel='load skew (Zipf exponent over the specialists)',
            title='gain vs load skew')
  for ax in (left, right):
    ax.axhline(1.0, color='k', lw=0.8, ls='--')
    ax.grid(alpha=0.3)
    ax.legend(fontsize='small')
  fig.suptitle('Merchant assistant, fitted workload; x1 = the fitted training cost')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  print(f'\ngain map: {path} ({len(points)} points, {time.perf_counter() - t0:.0f}s)')
  for (c, s), (gain, ratio) in sorted(points.items()):
    print(f'  training x{c:<5} Zipf {s:<4} train/rollout {ratio:6.2f}  gain {gain:5.2f}x')


def pool_sweep(meshes: list[int]) -> None:
  """The merchant workload on `meshes` training meshes of one node (the rest roll out),
  swaps blocking or overlapped: FlexMARL and no pipeline beside the paper's."""
  paper_s = dict(merchant_assistant.get_config().paper.step_time_s)
  variants = ('flexmarl', 'flexmarl_no_pipeline')
  print(f"\npool sweep (merchant, {_STEPS.value} steps): step s of {', '.join(variants)} "
        f"(paper {', '.join(str(paper_s[v]) for v in variants)})")
  for k in meshes:
    for overlapped in (False, True):
      steps = []
      for variant in variants:
        setup = merchant_assistant.get_config()
        setup.steps = _STEPS.value
        setup.training_meshes = setup.cluster.train_nodes = k
        setup.cluster.rollout_nodes = setup.cluster.nodes - k
        setup.overlapped_swaps = overlapped
        steps.append(simulate(setup, variant))
      print(f"  {k} meshes, swaps {'overlapped' if overlapped else 'blocking ':<10} "
            + '  '.join(f'{r.variant} {r.step_s:6.1f} (rollout {r.rollout_s:5.1f})'
                        for r in steps))


def main(argv):
  del argv
  for name in _SETUPS.value:
    run_setup(name)
  print('\nWorkload parameters and their sources (experiments/sim/paper.py):')
  for field, source in paper.SOURCES.items():
    print(f'  {field:<36} {source}')
  if _GAIN_MAP.value:
    draw_gain_map(_GAIN_MAP.value)
  if _POOL_SWEEP.value:
    pool_sweep([int(k) for k in _POOL_SWEEP.value])


if __name__ == '__main__':
  app.run(main)
