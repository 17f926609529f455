"""Simulate a paper setup on a cluster of any size, in seconds of wall time:

  python -m flexmarl.simulate --config=experiments/sim/merchant_assistant.py \
      [--schedules=flexmarl,colocated,agents_in_turn] [--workdir=DIR]

Prints, per variant (FlexMARL, its ablations, the baselines as built, the exact
references; `flexmarl.sim.run.VARIANTS`), the system it stands for, the mean step time
beside the paper's figure, the rollout time, critical-path bound and the utilization of
the rollout and training pools, in simulated seconds. With --workdir, each schedule's spans go to
DIR/SCHEDULE/trace.json (Perfetto opens it).
"""

from __future__ import annotations

import os

from absl import app, flags
from ml_collections import config_flags

from flexmarl.sim.run import VARIANTS, check_variant, format_results, simulate

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Simulator setup (experiments/sim/).')
_SCHEDULES = flags.DEFINE_list('schedules', None, f'Any of {list(VARIANTS)}; default: the '
                               "config's `schedules`.")
_WORKDIR = flags.DEFINE_string('workdir', None, 'Keep trace.json of each schedule under '
                               'WORKDIR/SCHEDULE (optional).')
flags.mark_flag_as_required('config')


def main(argv):
  del argv
  setup = _CONFIG.value
  variants = _SCHEDULES.value or list(setup.schedules)
  for v in variants:
    check_variant(v)
  results = []
  for v in variants:
    workdir = None
    if _WORKDIR.value:
      workdir = os.path.join(_WORKDIR.value, v)
      os.makedirs(workdir, exist_ok=True)
    results.append(simulate(setup, v, workdir))
    print(f'{v}: simulated {setup.steps} steps in {results[-1].wall_s:.1f}s', flush=True)
  print(format_results(results, dict(setup.paper.step_time_s)))


if __name__ == '__main__':
  app.run(main)
