"""The checked spec of a whole run (`TeamSpec`): what `flexmarl.config` makes of an
experiment config. Its own module, below the config's checks, so that the parts the
checks consult (the rollout backends, flexmarl.rollout.backends) can take a TeamSpec."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from flexmarl.models.layout import PROMPT_WIDTH_MULTIPLE
from flexmarl.placement import plan as placement_lib
from flexmarl.rollout.spec import RolloutSpec
from flexmarl.runtime import compile_cache
from flexmarl.spec.agent import AgentSpec
from flexmarl.spec.cluster import ClusterSpec
from flexmarl.train.spec import TrainingSpec


@dataclasses.dataclass(frozen=True)
class TeamSpec:
  seed: int
  steps: int
  schedule: str  # 'sync' | 'sync_parallel' | 'flexmarl' | 'async'
  max_staleness: int  # k of `async:k`; 0 (exactly on-policy) for the other schedules
  max_prompt_len: int
  tokenizer: str
  agents: Mapping[str, AgentSpec]
  rollout: RolloutSpec
  checkpoint_every: int
  training: TrainingSpec = TrainingSpec()
  # trace.json keeps the spans of the last trace_steps to 1.5 × trace_steps steps
  # (0: every step; see flexmarl.metrics.spans): a long run's trace stays openable.
  trace_steps: int = 1000
  # Store retention: at each checkpoint, drop the rows of steps older than the last
  # store_keep_steps (but those a kept checkpoint carries); 0 keeps every row.
  store_keep_steps: int = 0
  cluster: ClusterSpec = ClusterSpec()  # where the processes run (one, or a Ray cluster)
  # Compiled steps kept on disk between runs ('' keeps none; see flexmarl.runtime.compile_cache).
  compile_cache_dir: str = compile_cache.DEFAULT_DIR
  # Held-out evaluation (greedy pass@1, flexmarl.evaluate) before the first step, every
  # eval_every steps and after the last; 0: none. Needs a workflow with eval_queries().
  eval_every: int = 0
  # 'fit' or 'strict' (config.PLACEMENT_POLICIES); the placement itself needs the devices, so
  # `team_spec` leaves it None and `place_team` sets it.
  placement_policy: str = 'fit'
  placement: placement_lib.Placement | None = None
  # Prompts are padded to the batch's longest rounded up to this many tokens (sampler and
  # trainer alike): larger, fewer programs to compile and more padding to compute.
  prompt_width_multiple: int = PROMPT_WIDTH_MULTIPLE

  def evaluates_after(self, step: int) -> bool:
    """Whether held-out evaluation runs after `step` (0: before the first step)."""
    return bool(self.eval_every) and (step % self.eval_every == 0 or step == self.steps)
