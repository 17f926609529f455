"""GRPO, as pure functions.

Group-relative advantages, the clipped importance-ratio objective against the
behaviour logprobs, an optional KL penalty to a frozen reference (k3 estimator)
and an entropy bonus.

The loss is a token *sum*; the trainer divides the accumulated gradient by
`loss_divisor`: the number of response tokens in the agent's whole global batch
(`loss_norm='token'`, DAPO's token-level mean), or the constant rows × max_new_tokens
(`'constant'`, Dr. GRPO: no length bias at all). Because the gradient is linear in
that sum, micro-batches accumulated this way give exactly the update of the full
batch, however the batch is split.

Options from the field, all per agent:
- Dr. GRPO: `normalize_std=False` (no division by the group's reward std) with
  `loss_norm='constant'`.
- DAPO clip-higher: `clip_eps_low` / `clip_eps_high`, the ratio's clip range
  [1 - low, 1 + high] (both default to `clip_eps`).
- DAPO dynamic sampling: `dynamic_sampling=True` drops groups whose rewards are all
  equal (`zero_spread`: their advantages are 0, they teach nothing).
- The entropy bonus (`entropy_coef`, on by default) acts on each row in proportion to
  how much of its group is wrong (`entropy_weights`, `entropy_by_error`): it keeps an
  agent exploring where it is still wrong and fades where it is right. It can also be
  annealed to 0 over a number of updates (`entropy_decay_steps`).
- Truncated importance sampling (`tis_cap`, verl and slime's TIS): the policy term of
  each token weighted by min(pi_trainer / pi_sampler, cap), correcting for a sampler
  whose numbers differ from the trainer's; `mismatch_terms` measures that difference.
- No optimizer step from a batch without advantage signal (`skip_without_signal`, on
  by default; `takes_step`), unless the agent's batches have been mostly wrong without
  a signal several times in a row (`unstick_below`, `unstick_after`): a collapsed policy
  then steps on the bonus alone.
- Right answers balanced (`balance_answers`, `answer_weights`, off by default): where an
  agent's right answers are few and skewed, each group's advantages are weighted so that
  each right answer weighs the same.
- Agreeing groups against the agent's mean reward (`zero_spread_baseline`,
  `baseline_advantages`): a group whose samples all score the same is compared with the
  agent's recent mean reward instead of getting no advantage.
- Self-imitation (`self_imitation`, `train.replay`): a group whose samples are all wrong
  has its last sample replaced by the agent's own best answer so far for the same
  expected answer.
- An agent collapsed onto one answer (train/collapse.py: `collapse_share`, `collapse_after`)
  goes back to its starting weights (`resets_now`, at most `collapse_resets` times).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flexmarl.train.spec import GRPOConfig


def loss_divisor(cfg: GRPOConfig, tokens: int, rows: int) -> float:
  """What the global batch's summed loss (and gradient) is divided by.

  'token': its response tokens (each token weighs the same, DAPO); 'constant':
  rows × max_new_tokens, the same for every batch of that many rows (Dr. GRPO's
  constant normaliser: a long answer's tokens are not down-weighted).
  """
  if cfg.loss_norm == 'constant':
    return float(rows * cfg.max_new_tokens)
  return float(tokens)


def zero_spread(rewards) -> bool:
  """True when a group's rewards are all equal: GRPO gives it zero advantages."""
  r = np.asarray(rewards, np.float64)
  return bool(r.size == 0 or np.all(r == r.flat[0]))


def zero_spread_fraction(groups_rewards) -> float:
  """Fraction of groups (each a sequence of rewards) with zero spread; NaN for none."""
  groups = list(groups_rewards)
  return float(np.mean([zero_spread(g) for g in groups])) if groups else float('nan')


def silent(cfg: GRPOConfig, advantages: np.ndarray, correct: np.ndarray, replays: bool
           ) -> bool:
  """Whether a group adds exactly nothing to the gradient, so that its rows need not be
  run through the model: every advantage is 0 (its rewards agree) and nothing else in
  the loss reaches it: no KL term, no entropy bonus, no baseline for agreeing groups
  (`zero_spread_baseline`), and no self-imitation replay (`replays`: on, and every sample
  wrong). It still counts in the batch's divisor, so the update is the one the whole
  batch gives. A solved prompt (all samples right) is the common case: an agent that has
  learned its task costs little to keep training."""
  if cfg.kl_coef or cfg.entropy_coef or cfg.zero_spread_baseline:
    return False
  if np.any(np.asarray(advantages) != 0):
    return False
  c = np.asarray(correct)
  return not (replays and c.size and np.all(c == 0.0))


def entropy_coef_at(cfg: GRPOConfig, version: int) -> float:
  """The entropy bonus's coefficient for an agent's update number `version`: constant,
  or annealed linearly to 0 over `entropy_decay_steps` (a schedule tied to a number of
  updates; `entropy_by_error` fades it by progress instead)."""
  if not cfg.entropy_decay_steps:
    return cfg.entropy_coef
  return cfg.entropy_coef * max(0.0, 1.0 - version / cfg.entropy_decay_steps)


def entropy_weights(cfg: GRPOConfig, correct: Sequence[np.ndarray]) -> np.ndarray:
  """Per row of the groups given (each its rows' correctness: 1.0 / 0.0, NaN where the
  workflow did not say), the share of the entropy bonus the row gets: with
  `entropy_by_error`, the share of its group that is wrong (all of it where unknown),
  else 1.

  The bonus keeps a policy exploring where it is still wrong, so that its groups keep
  differing and GRPO keeps a signal; where it is right there is nothing left to find,
  and a bonus there only pushes a solved answer toward randomness (Adam turns that push
  into full-size steps once the group's advantages are 0). Scaled by the error, the
  bonus fades as an agent learns, prompt by prompt: a schedule that follows the
  agent's progress, not the run's length.
  """
  rows = [np.asarray(c, np.float64).ravel() for c in correct]
  sizes = np.array([r.size for r in rows], np.int64)
  if not cfg.entropy_by_error:
    return np.ones(sizes.sum(), np.float32)
  flat = np.concatenate(rows) if rows else np.zeros((0,), np.float64)
  group = np.repeat(np.arange(len(rows)), sizes)
  known = ~np.isnan(flat)
  counted = np.bincount(group, weights=known, minlength=len(rows))
  right = np.bincount(group, weights=np.where(known, flat, 0.0), minlength=len(rows))
  wrong = np.where(counted > 0, 1.0 - right / np.maximum(counted, 1), 1.0)
  return np.repeat(wrong, sizes).astype(np.float32)


def stuck(cfg: GRPOConfig, advantages: Sequence[np.ndarray],
          correct: Sequence[np.ndarray]) -> bool:
  """Whether a global batch looks like a policy collapsed onto a wrong answer: no
  advantage signal (every group's rewards equal) and most rows wrong (exact-match rate
  below `unstick_below`, over the rows whose correctness the workflow gave)."""
  if not all(np.all(np.asarray(a) == 0) for a in advantages):
    return False
  rows = np.concatenate([np.asarray(c, np.float64).reshape(-1) for c in correct] or [[]])
  known = rows[~np.isnan(rows)]
  return bool(known.size) and float(known.mean()) < cfg.unstick_below


def takes_step(cfg: GRPOConfig, advantages: Sequence[np.ndarray], stuck_run: int) -> bool:
  """Whether a global batch gets an optimizer step, from its groups' advantages and the
  number of the agent's batches in a row, this one included, that were `stuck`.

  A batch whose groups all had equal rewards has zero advantages; what is left of its
  gradient is the entropy bonus (and the KL term). Adam divides by the gradient's own
  scale, so that remainder, however small, still moves every parameter by about a
  learning rate (measured: the same step for entropy_coef 0.1 and 1e-6), and Adam's
  momentum moves them on even at a zero gradient. Measured, that goes wrong for a
  policy that is mostly right:
  - all right: a solved policy drifts until an answer flips, and once the wrong answer
    is certain the groups agree again and GRPO cannot correct it;
  - some wrong: the bonus on a few stuck rows, blown up to a full step, pushes the
    whole policy toward randomness, which makes more rows wrong and raises the bonus
    (a sorter that had reached 0.88 unlearning to 0.5; also from single small batches
    that were wrong by chance).
  So such a batch is skipped (no moment update, no parameter change; the agent's
  version still advances), unless the agent has been stuck for `unstick_after` batches
  in a row: then its policy has collapsed onto a wrong answer (a y/n verifier that says
  "n" to a solver that has become right: every group of two agrees), no batch will have
  a signal again, and a step on the bonus alone, which spreads the policy until its
  groups differ, is the only way out.
  """
  if not cfg.skip_without_signal or not all(np.all(np.asarray(a) == 0) for a in advantages):
    return True
  return bool(cfg.unstick_after) and stuck_run >= cfg.unstick_after


ANSWER_WINDOW = 1000  # calls whose right answers `answer_weights` balances
MAX_ANSWER_WEIGHT = 5.0


def answer_weights(cfg: GRPOConfig, counts: Mapping[str, int],
                   expected: Sequence[str | None]) -> np.ndarray:
  """Per group, the weight of its advantages: total / (K · count of its right answer),
  from `counts` of the right answers of the agent's recent calls (K of them, plus one
  each), capped at MAX_ANSWER_WEIGHT; 1 for a group without a right answer or an answer
  not counted, and for every group unless 2 <= K <= `balance_answers`; then scaled so
  that the groups' mean weight is 1, so that balancing moves the policy gradient
  between answers and not against the entropy bonus (unscaled, a batch of the common
  answer, weight ≈ 0.5, learned the answer format at half strength against a full
  bonus, and a verifier from random weights stayed in noise on 2 seeds of 3).

  Why: until a policy tells its prompts apart, GRPO's push on an answer is the sum over
  the groups whose right answer it is; a yes/no judge that sees "y" right three times in
  four is pushed onto "y" before it learns when to say "n", and stays there (measured:
  every seed of `experiments/claim_checker.py`, while the same task balanced learns).
  Weighted, each right answer pushes as hard as the others, as class-balanced losses do
  for skewed classes. Off by default: scaled, on 3 seeds (RESULTS.md), it brings the
  yes/no judges 0.02–0.30 above their constants, not the 0.3 a default must reach."""
  weights = np.ones(len(expected), np.float32)
  if not cfg.balance_answers or not 2 <= len(counts) <= cfg.balance_answers:
    return weights
  total = sum(counts.values()) + len(counts)
  for i, answer in enumerate(expected):
    if answer in counts:
      weights[i] = min(total / (len(counts) * (counts[answer] + 1)), MAX_ANSWER_WEIGHT)
  return weights / weights.mean()


def baseline_advantages(cfg: GRPOConfig, advantages: Sequence[np.ndarray],
                        rewards: Sequence[np.ndarray], recent: Sequence[float]
                        ) -> list[np.ndarray]:
  """Per group, its advantages; a group whose rewards all agree (`zero_spread`) gets
  `zero_spread_baseline` × (its reward − the mean of `recent`, the agent's rewards in its
  last batch) instead of 0, where that option is on and `recent` is not empty.

  Why: GRPO compares a sample only with its own group. A prompt that every sample answers
  the same wrong way teaches nothing, however many updates pass (measured: a sorter and
  an adder of the default experiment each stuck on one wrong answer for a few prompts,
  1,000 updates long); and a yes/no judge that sees "y" right three times in four is
  pushed onto "y" by the groups where it is right and held by nothing where it is wrong,
  once those groups agree. Against the agent's own mean reward (REINFORCE's baseline,
  taken from earlier batches so that every schedule computes the same), an agreeing
  wrong group is pushed off its answer and a constant that is right on most prompts
  gains nothing on balance: the push is up where it is right (1 − mean) and down where it
  is wrong (−mean), which cancel at the constant's own rate. Measured, it did not lift
  those plateaus (an answer held at p ≈ 1 has a log-probability gradient of ≈ 0 whatever
  the advantage), and a policy from random weights, whose groups are mostly all wrong,
  was held near uniform by it (each such group pushed down on what it sampled), so it
  is off by default (RESULTS.md)."""
  if not cfg.zero_spread_baseline or not len(recent):
    return [np.asarray(a, np.float32) for a in advantages]
  mean = float(np.mean(recent))
  return [np.full(len(r), cfg.zero_spread_baseline * (float(r[0]) - mean), np.float32)
          if zero_spread(r) and len(r) else np.asarray(a, np.float32)
          for a, r in zip(advantages, rewards)]


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0
                   ) -> tuple[jax.Array, jax.Array]:
  """Logprob of each target token and the entropy of each position's distribution."""
  logp = jax.nn.log_softmax(logits / temperature, axis=-1)
  # A one-hot contraction, not a gather: its gradient is dense, where a gather's is a
  # scatter-add, which is slow on CPU.
  picked = jnp.sum(logp * jax.nn.one_hot(targets, logp.shape[-1], dtype=logp.dtype), axis=-1)
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return picked, entropy


def tis_weights(logprobs: jax.Array, sampler_logprobs: jax.Array, cap: float) -> jax.Array:
  """Truncated importance weights [B, T]: min(pi_trainer / pi_sampler, cap) of each
  sampled token, without gradient (the trainer's logprobs at the parameters that
  sampled it)."""
  return jnp.minimum(jnp.exp(jax.lax.stop_gradient(logprobs) - sampler_logprobs), cap)


def mismatch_terms(logprobs: jax.Array, sampler_logprobs: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  """Per token: |Δ logprob| between trainer and sampler, and the k3 estimate of
  KL(sampler || trainer) (r - 1 - log r with r = pi_trainer / pi_sampler, unbiased under
  the sampler's tokens, >= 0). Both 0 where the two agree exactly."""
  delta = jax.lax.stop_gradient(logprobs) - sampler_logprobs
  return jnp.abs(delta), jnp.exp(delta) - 1.0 - delta


def grpo_token_loss(logprobs: jax.Array, behaviour_logprobs: jax.Array,
                    advantages: jax.Array, entropy: jax.Array,
                    ref_logprobs: jax.Array | None, cfg: GRPOConfig,
                    entropy_coef: jax.Array | float,
                    tis_weight: jax.Array | None = None) -> jax.Array:
  """Per-token loss [B, T] (to be masked and summed).

  advantages: [B], broadcast over a row's tokens; entropy_coef: a scalar, or [B, 1]
  (per row: `entropy_weights` times the coefficient); tis_weight: [B, T] truncated
  importance weights of the policy term (`tis_weights`), or None.
  """
  ratio = jnp.exp(logprobs - behaviour_logprobs)
  adv = advantages[:, None]
  low, high = cfg.clip_range
  clipped = jnp.clip(ratio, 1.0 - low, 1.0 + high)
  policy = -jnp.minimum(ratio * adv, clipped * adv)
  if tis_weight is not None:
    policy = tis_weight * policy
  loss = policy - entropy_coef * entropy
  if ref_logprobs is not None and cfg.kl_coef:
    log_r = ref_logprobs - logprobs
    loss = loss + cfg.kl_coef * (jnp.exp(log_r) - log_r - 1.0)  # k3 estimator
  return loss


def clipped_fraction_terms(ratio: jax.Array, cfg: GRPOConfig) -> jax.Array:
  """1.0 where the ratio lies outside the clip range, else 0.0 (a diagnostic)."""
  low, high = cfg.clip_range
  return ((ratio < 1.0 - low) | (ratio > 1.0 + high)).astype(jnp.float32)


def masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(jnp.where(mask, x, 0.0))
