"""What observing costs: a span recorded to trace.json, and a RealClock wait.

  python experiments/benchmarks/spans.py [--spans=20000]

Records `spans` spans on 16 tracks through `SpanRecorder.add` (streamed to a trace.json
in a temporary folder, flushed per span) and through the `span()` context manager, then
computes a step report over them. Then waits on a pending that becomes done after 5 ms
(set by another thread) `waits` times: reports how late `wait_any` returns and how much
CPU it uses while waiting. The last line is JSON.
"""

import json
import tempfile
import threading
import time

from absl import app, flags

from flexmarl.core.clock import RealClock
from flexmarl.metrics import spans as sp
from flexmarl.metrics import utilization as ut

_SPANS = flags.DEFINE_integer('spans', 20_000, 'Spans to record.')
_WAITS = flags.DEFINE_integer('waits', 100, 'Waits on a 5 ms pending.')


class _Flag:

  def __init__(self):
    self.event = threading.Event()

  def done(self) -> bool:
    return self.event.is_set()


def main(argv):
  del argv
  clock = RealClock()
  n = _SPANS.value
  with tempfile.TemporaryDirectory() as workdir:
    rec = sp.SpanRecorder.for_workdir(clock, workdir)
    t0 = time.perf_counter()
    base = clock.now()
    for i in range(n):
      rec.add(f'rollout:a/{i % 16}', sp.GENERATE, base + i * 1e-4, base + i * 1e-4 + 5e-4, agent='a', version=i // 1000,
              tokens=256, step=i // 1000)
    add_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for i in range(n):
      with rec.span('train:a', sp.MICRO_BATCH, agent='a', version=0, step=i // 1000):
        pass
    ctx_us = (time.perf_counter() - t0) / n * 1e6
    rec.close()
    t0 = time.perf_counter()
    spans = sp.load_spans(f'{workdir}/{sp.TRACE_FILE}')
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ut.step_report(spans)
    report_s = time.perf_counter() - t0
  late, cpu, wall = [], 0.0, 0.0
  for _ in range(_WAITS.value):
    flag = _Flag()
    timer = threading.Timer(0.005, flag.event.set)
    c0, w0 = time.process_time(), time.perf_counter()
    timer.start()
    clock.wait_any([flag])
    done_at = time.perf_counter()
    cpu += time.process_time() - c0
    wall += done_at - w0
    late.append(done_at - w0 - 0.005)
  late.sort()
  out = {'add_us': add_us, 'span_ctx_us': ctx_us, 'load_spans_s': load_s,
         'step_report_s': report_s, 'spans': 2 * n,
         'wait_late_ms_median': late[len(late) // 2] * 1e3, 'wait_late_ms_max': late[-1] * 1e3,
         'wait_cpu_share': cpu / wall}
  for k, v in out.items():
    print(f'{k:>22}: {v:.4g}')
  print(json.dumps(out))


if __name__ == '__main__':
  app.run(main)
