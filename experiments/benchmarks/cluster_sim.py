"""Every paper setup under every schedule in the simulator, next to the paper's figures.

  PYTHONPATH=. python -m experiments.benchmarks.cluster_sim [--setups=merchant,15x14b]
      [--steps=3] [--query_concurrency=0]

Prints per setup and schedule: mean step time, rollout time, critical-path bound,
utilization of the rollout and training pools (simulated seconds), the paper's step
time where it is known, the speed-ups flexmarl / sync_parallel and flexmarl / sync,
and the real seconds each setup took to simulate.
"""

from __future__ import annotations

import time

from absl import app, flags

from experiments.sim import category_assistant, merchant_assistant, scalability
from flexmarl.sim.run import VARIANTS, format_results, simulate

SETUPS = {
    'merchant': merchant_assistant.get_config,
    'category': category_assistant.get_config,
    '5x32b': lambda: scalability.get_config('5x32b'),
    '3x32b+7x14b': lambda: scalability.get_config('3x32b+7x14b'),
    '15x14b': lambda: scalability.get_config('15x14b'),
}

_SETUPS = flags.DEFINE_list('setups', list(SETUPS), f'Any of {list(SETUPS)}.')
_SCHEDULES = flags.DEFINE_list('schedules', list(VARIANTS), f'Any of {list(VARIANTS)}.')
_STEPS = flags.DEFINE_integer('steps', 3, 'Simulated steps per schedule.')
_CONCURRENCY = flags.DEFINE_integer('query_concurrency', 0,
                                    'Queries in flight (0: the paper\'s query parallelism, 4).')


def main(argv):
  del argv
  for name in _SETUPS.value:
    setup = SETUPS[name]()
    setup.steps = _STEPS.value
    setup.query_concurrency = _CONCURRENCY.value
    t0 = time.perf_counter()
    results = [simulate(setup, v) for v in _SCHEDULES.value]
    print(f'\n## {name}: {len(setup.agents)} agents, {_STEPS.value} steps, '
          f'{setup.query_concurrency or setup.query_parallelism} queries in flight '
          f'(simulated in {time.perf_counter() - t0:.1f}s)')
    print(format_results(results, dict(setup.paper.step_time_s)))


if __name__ == '__main__':
  app.run(main)
