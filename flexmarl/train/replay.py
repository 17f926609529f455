"""Self-imitation: an agent's own right answers, replayed where all its samples are wrong.

A group whose samples are all wrong gives GRPO nothing to rank; `replays` gives it, in
place of its last sample, the agent's last right answer to a call with the same expected
answer (`remember_right` keeps them), trained with advantage `GRPOConfig.self_imitation`. Pure
functions over a memory the agent owns (and its checkpoint keeps)."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl.train.spec import GRPOConfig

REPLAY_MEMORY = 1000  # expected answers whose last right sample an agent remembers


def remember_right(memory: collections.OrderedDict, expected: str | None,
                   correct: np.ndarray, tokens: Sequence[np.ndarray]) -> None:
  """Keep in `memory` (expected answer → response tokens, most recent last, at most
  REPLAY_MEMORY of them) the last of a group's samples that was right."""
  right = [t for t, c in zip(tokens, np.asarray(correct, np.float64).ravel()) if c == 1.0]
  if expected is None or not right:
    return
  memory[expected] = np.asarray(right[-1])
  memory.move_to_end(expected)
  while len(memory) > REPLAY_MEMORY:
    memory.popitem(last=False)


def replays(cfg: GRPOConfig, expected: Sequence[str | None], correct: Sequence[np.ndarray],
            memory: Mapping[str, np.ndarray]) -> list[np.ndarray | None]:
  """Per group, the response tokens to replay with it (advantage `self_imitation`), or
  None: a group whose samples are all wrong gets the agent's own last right answer to a
  call with the same expected answer, where it has one (`remember_right`).

  Why: a prompt that every sample answers one wrong way gives GRPO nothing to rank, and
  the policy's gradient on the answer it is sure of, (1 − p), vanishes, so such prompts
  stay wrong (a sorter's `11=` → `111`, a yes/no checker's off-by-one claims: RESULTS.md).
  The right answer's own gradient is largest exactly there (its p is near 0), and it
  moves probability to that answer, not to every token: pushing the wrong answer off
  (unlikelihood) spread it over every token and drove judges into noise. This is
  self-imitation learning (Oh et al., 2018, "Self-Imitation Learning"): the agent
  imitates its own rewarded behaviour, here an answer the workflow judged right for the
  same expected answer. The replayed row is trained on-policy (the trainer's own
  logprob is its behaviour: ratio 1), in the place of one of the group's samples."""
  if not cfg.self_imitation:
    return [None] * len(expected)
  return [memory.get(e) if e is not None and np.size(c) and np.all(np.asarray(c) == 0.0)
          else None for e, c in zip(expected, correct)]
