"""Self-imitation: an agent's own best answers, replayed where all its samples are worse.

A group whose samples are all wrong gives GRPO nothing to rank; `replays` gives it, in
place of its last sample, the agent's best answer so far to a call with the same expected
answer (`remember_best` keeps them), trained with advantage `GRPOConfig.self_imitation`;
with `self_imitation_key='prompt'`, only to a call with the same prompt too (`prompt_key`),
for responses that are reasoning ending in the answer.
Pure functions over a memory the agent owns (and its checkpoint keeps)."""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from flexmarl.train.spec import GRPOConfig

REPLAY_MEMORY = 1000  # expected answers whose best sample an agent remembers


def prompt_key(expected: str, prompt_ids: Sequence[int]) -> str:
  """The memory key of one prompt with its expected answer (`self_imitation_key='prompt'`):
  a kept answer is replayed only into that prompt. A digest of the ids keeps the key short
  (the checkpoint stores the keys)."""
  digest = hashlib.sha256(np.asarray(prompt_ids, np.int64).tobytes()).hexdigest()[:16]
  return f'{expected}#{digest}'


class Best(NamedTuple):
  """An agent's best sample so far for one expected answer."""

  tokens: np.ndarray  # its response tokens
  reward: float
  right: bool  # the workflow judged it right


def remember_best(memory: collections.OrderedDict, expected: str | None,
                  rewards: np.ndarray, correct: np.ndarray,
                  tokens: Sequence[np.ndarray]) -> None:
  """Keep in `memory` (expected answer → `Best`, most recently changed last, at most
  REPLAY_MEMORY of them) the best of a group's samples: the last right one, or, while
  none has been right, the highest-rewarded wrong one that beats what is kept.

  Why the wrong ones: an answer never once right has nothing to replay, and a policy can
  lose its way to it before it gets there: a yes/no checker whose claims are mostly right
  found `n` followed by a stray letter (half the partial credit), never `n` alone, then
  said `y` to everything (RESULTS.md). Its best partial answer is still a step toward
  the right one."""
  if expected is None or not len(tokens):
    return
  correct = np.asarray(correct, np.float64).ravel()
  rewards = np.asarray(rewards, np.float64).ravel()
  right = np.flatnonzero(correct == 1.0)
  if right.size:
    i = int(right[-1])
    memory[expected] = Best(np.asarray(tokens[i]), float(rewards[i]), True)
  else:
    i = int(np.argmax(rewards))
    kept = memory.get(expected)
    if kept is not None and (kept.right or kept.reward >= rewards[i]):
      return
    if not rewards[i] > 0.0:
      return
    memory[expected] = Best(np.asarray(tokens[i]), float(rewards[i]), False)
  memory.move_to_end(expected)
  while len(memory) > REPLAY_MEMORY:
    memory.popitem(last=False)


def replays(cfg: GRPOConfig, expected: Sequence[str | None], rewards: Sequence[np.ndarray],
            correct: Sequence[np.ndarray], memory: Mapping[str, Best]
            ) -> list[np.ndarray | None]:
  """Per group, the response tokens to replay in it (advantage `self_imitation`), or
  None: a group whose samples are all wrong gets the agent's best answer so far to a call
  with the same expected answer (`remember_best`), where it has one that is right or
  scored more than every sample of the group.

  Why: a prompt that every sample answers one wrong way gives GRPO nothing to rank, and
  the policy's gradient on the answer it is sure of, (1 − p), vanishes, so such prompts
  stay wrong (a sorter's `11=` → `111`, a yes/no checker's off-by-one claims: RESULTS.md).
  The right answer's own gradient is largest exactly there (its p is near 0), and it
  moves probability to that answer, not to every token: pushing the wrong answer off
  (unlikelihood) spread it over every token and drove judges into noise. This is
  self-imitation learning (Oh et al., 2018, "Self-Imitation Learning"): the agent
  imitates its own past behaviour where it did better than it does now. The replayed
  row is trained on-policy (the trainer's own logprob is its behaviour: ratio 1), in the
  place of one of the group's samples."""
  if not cfg.self_imitation:
    return [None] * len(expected)
  out = []
  for e, r, c in zip(expected, rewards, correct):
    best = memory.get(e) if e is not None else None
    wrong = np.size(c) and np.all(np.asarray(c) == 0.0)
    out.append(best.tokens if best is not None and wrong
               and (best.right or best.reward > np.max(r)) else None)
  return out
