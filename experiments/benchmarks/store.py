"""ExperienceStore write/read throughput and size on disk, on local files.

  python experiments/benchmarks/store.py [--rows=10000] [--batch=256] [--dir=/tmp/x]

Writes `rows` rows to one agent table in appends of `batch` rows: response lengths uniform in
[min_response, max_response] tokens, prompts of `prompt` ± 16 tokens, token ids uniform in a
32k vocabulary, logprobs log(U(0.05, 1)) as float32 (random data: real token streams and
logprobs compress better). Then reads every row back (a fresh store object, so nothing is
cached) and checks a sample of rows. Reports rows/s and tokens/s (prompt + response) written
and read, the wall and CPU time of one append (a run's appends share the cores with its
step), and bytes per token on disk (the table folder's size / all tokens). The last line is
JSON. A GRPO step's append (`grpo_step.py`: 128 rows of at most 8 tokens):

  python experiments/benchmarks/store.py --rows=12800 --batch=128 --min_response=1 \
    --max_response=8 --prompt=20
"""

import json
import os
import tempfile
import time

import numpy as np
from absl import app, flags

from flexmarl.store.experience_store import ExperienceStore, Row

_ROWS = flags.DEFINE_integer('rows', 10_000, 'Rows to write.')
_BATCH = flags.DEFINE_integer('batch', 256, 'Rows per append.')
_MIN = flags.DEFINE_integer('min_response', 128, 'Shortest response, tokens.')
_MAX = flags.DEFINE_integer('max_response', 2048, 'Longest response, tokens.')
_PROMPT = flags.DEFINE_integer('prompt', 64, 'Mean prompt length, tokens.')
_DIR = flags.DEFINE_string('dir', None, 'Store location (default: a temporary folder).')
_VOCAB = 32_000


def _rows(rng: np.random.Generator, n: int) -> list[Row]:
  out = []
  for i in range(n):
    length = int(rng.integers(_MIN.value, _MAX.value + 1))
    prompt = rng.integers(0, _VOCAB, _PROMPT.value + int(rng.integers(-16, 17)), dtype=np.int32)
    out.append(Row(f'q{i // 8}_0_{i % 8}', 0, prompt,
                   rng.integers(0, _VOCAB, length, dtype=np.int32),
                   np.log(rng.uniform(0.05, 1.0, length)).astype(np.float32)))
  return out


def _du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  rows = _rows(rng, _ROWS.value)
  tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in rows)
  with tempfile.TemporaryDirectory() as tmp:
    path = _DIR.value or os.path.join(tmp, 'store')
    store = ExperienceStore.open(path, agents=['solver'])
    t0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(0, len(rows), _BATCH.value):
      store.append('solver', rows[i:i + _BATCH.value])
    write_s, write_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    store.close()

    t0 = time.perf_counter()
    store = ExperienceStore.open(path, agents=['solver'])
    back = store.read('solver')
    read_s = time.perf_counter() - t0
    assert len(back) == len(rows)
    for i in rng.choice(len(rows), 100, replace=False):
      assert back[i].sample_id == rows[i].sample_id
      assert np.array_equal(back[i].response_ids, rows[i].response_ids)
      assert np.array_equal(back[i].logprobs, rows[i].logprobs)
    disk = _du(path)
  appends = -(-len(rows) // _BATCH.value)
  result = dict(rows=len(rows), tokens=tokens, write_rows_per_s=len(rows) / write_s,
                write_tokens_per_s=tokens / write_s, read_rows_per_s=len(rows) / read_s,
                read_tokens_per_s=tokens / read_s, bytes_per_token=disk / tokens,
                write_s=write_s, read_s=read_s,
                append_ms=write_s / appends * 1e3, append_cpu_ms=write_cpu_s / appends * 1e3)
  print(f"wrote {len(rows)} rows ({tokens / 1e6:.1f}M tokens) in {write_s:.2f}s: "
        f"{result['write_rows_per_s']:.0f} rows/s, "
        f"{result['write_tokens_per_s'] / 1e6:.2f}M tok/s; "
        f"read back in {read_s:.2f}s: {result['read_rows_per_s']:.0f} rows/s, "
        f"{result['read_tokens_per_s'] / 1e6:.2f}M tok/s; {result['bytes_per_token']:.2f} B/token "
        'on disk (4 B id + 4 B logprob per response token raw)')
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main)
