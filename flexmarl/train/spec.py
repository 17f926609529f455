"""The training tier's specs: an agent's optimizer (`OptimizerConfig`) and GRPO loss
(`GRPOConfig`), and the training pool (`TrainingSpec`, config section `training`).
Each field and its default are written once, here; each spec checks its own fields.
Imports nothing heavy: the config reads it before anything compiles."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import ml_collections

from flexmarl.train.credit import CREDITS, EPISODE_CREDITS, ESTIMATORS
from flexmarl.spec.validate import (DERIVED, config_of, fail, in_range, number, one_of,
                               read_section, whole_number)

LOSS_NORMS = ('token', 'constant')
REPLAY_KEYS = ('answer', 'prompt')  # grpo.self_imitation_key


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with global-norm clipping (config `agents.NAME.optimizer`)."""

  learning_rate: float = 3e-3
  b1: float = 0.9
  b2: float = 0.99
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  warmup_steps: int = 0  # linear warm-up of the learning rate over this many updates
  decay_steps: int = 0  # then cosine decay of the learning rate over this many updates (0: constant)
  final_lr_fraction: float = 0.1

  @classmethod
  def from_config(cls, field: str, values: Mapping[str, Any] | None) -> OptimizerConfig:
    o = read_section(cls, field, values)
    for key in ('learning_rate', 'max_grad_norm'):
      if not number(f'{field}.{key}', getattr(o, key)) > 0:
        fail(f'{field}.{key}', getattr(o, key), 'must be > 0.')
    for key in ('b1', 'b2'):
      in_range(f'{field}.{key}', getattr(o, key), 0.0, 0.999999, 'must be in [0, 1).')
    in_range(f'{field}.weight_decay', o.weight_decay, 0.0, math.inf)
    in_range(f'{field}.final_lr_fraction', o.final_lr_fraction, 0.0, 1.0)
    whole_number(f'{field}.decay_steps', o.decay_steps, 0)
    whole_number(f'{field}.warmup_steps', o.warmup_steps, 0)
    return o


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """The GRPO loss (config `agents.NAME.grpo`; see flexmarl.train.grpo)."""

  # Which samples are compared with which (train/credit.py's CREDITS): 'call' (one
  # generate call's samples), 'episode' (a query's attempts side by side, each turn
  # credited with its attempt's outcome), 'episode_agent' (the same, normalised by the
  # agent's own statistics: Dr. MAS).
  credit: str = 'call'
  # Under episode credit: a turn's own rewards (Episode.score's), discounted over the
  # agent's later turns of its attempt, times this, added to the outcome. 0: outcome only.
  turn_reward_coef: float = 0.0
  turn_discount: float = 1.0
  # The advantage estimator of call groups, by its name in train/credit.py's registry.
  advantage: str = 'grpo'
  clip_eps: float = 0.2
  clip_eps_low: float | None = None  # ratio >= 1 - clip_eps_low (None: clip_eps) ...
  clip_eps_high: float | None = None  # ... and <= 1 + clip_eps_high (DAPO: 0.28).
  kl_coef: float = 0.0  # > 0 keeps a frozen reference policy and adds k3 KL.
  # The entropy bonus: each row's times the share of its group that is wrong
  # (`entropy_by_error`, grpo.entropy_weights), so an agent keeps exploring where it is
  # wrong and stays sharp where it is right. 0.2 was measured on the robustness suite
  # (experiments/benchmarks/RESULTS.md).
  entropy_coef: float = 0.2
  entropy_by_error: bool = True  # off: every row gets the whole bonus
  entropy_decay_steps: int = 0  # anneal the bonus linearly to 0 over this many updates
  normalize_std: bool = True  # divide advantages by the group's std (GRPO); off: Dr. GRPO.
  loss_norm: str = 'token'  # 'token': / tokens of the global batch; 'constant': Dr. GRPO.
  dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal.
  # No optimizer step from a batch whose advantages are all 0 (see grpo.takes_step) ...
  skip_without_signal: bool = True
  # ... unless the agent's batches were mostly wrong (accuracy below `unstick_below`) and
  # without signal `unstick_after` times in a row: a policy collapsed onto a wrong answer
  # has groups that all agree, and only the bonus can move it. unstick_after=0: never.
  unstick_below: float = 0.5
  unstick_after: int = 5
  # Collapse onto one answer (train/collapse.py): after `collapse_after` batches in a row
  # whose sampled answers were at least `collapse_share` one answer where the right
  # answers differ, the run says so and resets the agent to its starting weights with a
  # fresh optimizer, at most `collapse_resets` times a run (0: only the warning).
  # collapse_after=0: never.
  collapse_share: float = 0.9
  collapse_after: int = 3
  collapse_resets: int = 2
  # Groups weighted so that every right answer weighs the same (grpo.answer_weights),
  # over the agent's last ANSWER_WINDOW calls, where those have 2 to `balance_answers`
  # distinct right answers (a yes/no judge that sees mostly right answers). 0: off, the
  # default: 10 taught an imbalanced checker but broke a verifier and slowed an adder
  # (experiments/benchmarks/RESULTS-log-2026.md, "Two options measured and left off").
  balance_answers: int = 0
  # A group whose rewards all agree gets (reward - the agent's mean reward in its last
  # batch) × this as its rows' advantage, instead of GRPO's 0
  # (grpo.baseline_advantages): a prompt answered wrong by every sample is pushed off that
  # answer, and a constant answer that is right on most prompts is no longer pushed up by
  # them. 0: off (GRPO).
  zero_spread_baseline: float = 0.0
  # A group whose samples are all wrong has its last sample replaced by the agent's own
  # best answer so far to a call with the same expected answer (its last right one, or
  # its best-scored while none was right), with this as its advantage (train.replay;
  # self-imitation): a prompt answered one wrong way with certainty, which GRPO cannot
  # rank, is pulled toward an answer the agent has been rewarded for. Needs the
  # workflow's `expected` answers and correctness. 0: off (RESULTS.md, "Self-imitation").
  self_imitation: float = 1.0
  # What a kept answer is replayed into: 'answer', any call with the same expected
  # answer (right where the response is the answer itself); 'prompt', only the same
  # prompt with that expected answer (for responses that reason their way to the answer:
  # one problem's reasoning would be wrong under another problem's prompt).
  self_imitation_key: str = 'answer'
  # Truncated importance sampling (verl, slime): each token's loss is weighted by
  # min(pi_trainer / pi_sampler, tis_cap), the trainer's probability of the sampled token
  # (at the parameters that sampled it, no gradient) over the sampler's, capped: it
  # corrects for the sampler's numbers differing from the trainer's (vLLM kernels, bf16).
  # 0: off (the sampler's tokens are trained as if the trainer had drawn them).
  tis_cap: float = 0.0
  # From the agent's sampling section:
  temperature: float = dataclasses.field(default=1.0, metadata=DERIVED)  # of the logprobs
  max_new_tokens: int = dataclasses.field(default=0, metadata=DERIVED)  # 'constant' normaliser

  @property
  def clip_range(self) -> tuple[float, float]:
    """(low, high): the ratio is clipped to [1 - low, 1 + high]."""
    low = self.clip_eps if self.clip_eps_low is None else self.clip_eps_low
    high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
    return low, high

  @classmethod
  def from_config(cls, field: str, values: Mapping[str, Any] | None, temperature: float,
                  max_new_tokens: int) -> GRPOConfig:
    g = read_section(cls, field, values, temperature=temperature,
                     max_new_tokens=max_new_tokens)
    for key in ('clip_eps', 'clip_eps_low', 'clip_eps_high'):
      if getattr(g, key) is not None:
        in_range(f'{field}.{key}', getattr(g, key), 0.0, math.inf, 'must be >= 0 (0.2 is '
                 'usual; DAPO uses clip_eps_high=0.28).')
    if g.clip_eps_low is not None and g.clip_eps_low >= 1:
      fail(f'{field}.clip_eps_low', g.clip_eps_low, 'must be < 1 (the ratio stays > 0).')
    for key in ('kl_coef', 'entropy_coef'):
      in_range(f'{field}.{key}', getattr(g, key), 0.0, math.inf, 'must be >= 0.')
    if g.tis_cap and not number(f'{field}.tis_cap', g.tis_cap) >= 1:
      fail(f'{field}.tis_cap', g.tis_cap, 'give 0 (off) or a cap >= 1 (verl uses 2).')
    whole_number(f'{field}.entropy_decay_steps', g.entropy_decay_steps, 0)
    in_range(f'{field}.unstick_below', g.unstick_below, 0.0, 1.0,
             'is an accuracy, 0 to 1.')
    whole_number(f'{field}.unstick_after', g.unstick_after, 0)
    in_range(f'{field}.collapse_share', g.collapse_share, 0.0, 1.0,
             'is a share of a batch\'s answers, 0 to 1 (0.9: nine in ten alike).')
    whole_number(f'{field}.collapse_after', g.collapse_after, 0)
    whole_number(f'{field}.collapse_resets', g.collapse_resets, 0)
    whole_number(f'{field}.balance_answers', g.balance_answers, 0)
    in_range(f'{field}.self_imitation', g.self_imitation, 0.0, math.inf,
             'must be >= 0 (0: off; 1: a replayed answer weighs as a right sample does).')
    in_range(f'{field}.zero_spread_baseline', g.zero_spread_baseline, 0.0, math.inf,
             'must be >= 0 (0: off; 1: the reward\'s distance from the agent\'s mean).')
    one_of(f'{field}.self_imitation_key', g.self_imitation_key, REPLAY_KEYS)
    one_of(f'{field}.loss_norm', g.loss_norm, LOSS_NORMS)
    one_of(f'{field}.advantage', g.advantage, tuple(ESTIMATORS))
    one_of(f'{field}.credit', g.credit, tuple(CREDITS))
    in_range(f'{field}.turn_reward_coef', g.turn_reward_coef, -math.inf, math.inf,
             'must be a finite number (0: the outcome alone).')
    in_range(f'{field}.turn_discount', g.turn_discount, 0.0, 1.0,
             'discounts later turns: 0 to 1 (1: every later turn counts in full).')
    if g.credit not in EPISODE_CREDITS and g.turn_reward_coef:
      fail(f'{field}.turn_reward_coef', g.turn_reward_coef, f'adds turn rewards to an '
           f"episode's outcome, and under {field}.credit={g.credit!r} there is none (each "
           "sample is scored by its own reward already); set it to 0, or use "
           f'credit in {sorted(EPISODE_CREDITS)}.')
    if g.credit in EPISODE_CREDITS:
      # A turn is a group of one sample there: these compare the samples of one call.
      for name, on in (('zero_spread_baseline', g.zero_spread_baseline > 0),
                       ('dynamic_sampling', g.dynamic_sampling)):
        if on:
          fail(f'{field}.{name}', getattr(g, name), f'compares the samples of one call, and '
               f'under {field}.credit={g.credit!r} a turn is one sample; turn it off, or '
               "use credit='call'.")
    return g


@dataclasses.dataclass(frozen=True)
class TrainingSpec:
  """The training pool (config section `training`, optional).

  - pool_devices: 0 gives every agent a mesh of its own (`agents.X.mesh_shape`, on
    devices of its own). N > 0 carves the first N free devices into meshes that the
    agents share, taking turns: an agent is bound to a free mesh of its shape while it
    has a micro-batch or an optimizer step to run, and its state waits in host memory
    (or storage) in between. With 0 and too few devices for a mesh per agent,
    placement may fit a pool over every device (`config.placement`: 'fit', the
    default; 'strict' refuses instead).
  - mesh_shapes: the pool's meshes, e.g. [(2,), (2,)]; () derives one mesh per distinct
    agent shape, then more round-robin while devices remain.
  - host_budget_gb: host memory for swapped-out states; the least recently used go to
    storage beyond it (0: unlimited).
  - storage_dir: where states swapped to storage go ('': WORKDIR/swap).
  - states_per_mesh: agents' states a pool mesh holds at once. 2: the next agent's
    state comes in while the resident computes, and an agent that will train again
    this step keeps its state on a mesh it leaves, so swaps hide behind compute. 1,
    where a mesh's memory holds one state only: every swap waits for the one before.
  """

  pool_devices: int = 0
  mesh_shapes: tuple[tuple[int, ...], ...] = ()
  host_budget_gb: float = 0.0
  storage_dir: str = ''
  states_per_mesh: int = 2

  @property
  def host_budget_bytes(self) -> int:
    return int(self.host_budget_gb * 1e9)

  @classmethod
  def from_config(cls, values: Mapping[str, Any] | None, field: str = 'training'
                  ) -> TrainingSpec:
    """The checked spec; whether each agent's mesh and state fit the pool is checked
    with the agents (flexmarl.train.sizing)."""
    t = read_section(cls, field, values)
    whole_number(f'{field}.pool_devices', t.pool_devices, 0, '0: every agent on its own mesh')
    in_range(f'{field}.host_budget_gb', t.host_budget_gb, 0.0, math.inf,
             'must be >= 0 (0: unlimited).')
    one_of(f'{field}.states_per_mesh', t.states_per_mesh, (1, 2))
    if not t.pool_devices and (t.mesh_shapes or t.host_budget_gb):
      fail(f'{field}.pool_devices', t.pool_devices, 'mesh_shapes and host_budget_gb need a '
           'training pool: give it devices, or leave them unset.')
    return dataclasses.replace(t, mesh_shapes=tuple(tuple(s) for s in t.mesh_shapes))


def training_config(**overrides: Any) -> ml_collections.ConfigDict:
  """Default training-pool config (the fields of `TrainingSpec`)."""
  return config_of(TrainingSpec, **overrides)
