"""The library entry point: `build` a checked team over a workdir, `train` it.

Scripts, notebooks and benchmarks import this module; it defines no command-line
flags (`flexmarl.main` does), so a script with its own absl flags can use it.
"""

from __future__ import annotations

import logging as std_logging
import os

from absl import flags, logging

from flexmarl.runtime import malloc


def quiet_logging() -> None:
  """Keep the INFO lines of absl and Orbax out of a run's progress lines.

  Only those two loggers change level (to WARNING), and only while they are at
  their default; a `--verbosity` given on the command line is kept.
  """
  given = flags.FLAGS.is_parsed() and flags.FLAGS['verbosity'].present
  if not given and logging.get_verbosity() > logging.WARNING:  # INFO after app.run
    logging.set_verbosity(logging.WARNING)
  orbax = std_logging.getLogger('orbax')
  if orbax.level == std_logging.NOTSET:
    orbax.setLevel(std_logging.WARNING)


def build(config, workdir: str, workflow=None, log=print, experiment: str | None = None):
  """Check the config, the workflow and the workdir, then build the team's
  JointOrchestrator over `workdir`.

  `workflow`: a Workflow object (see flexmarl.workflows.base); by default the one
  that `config.workflow` names (a built-in, or `package.module:Class`). `experiment`:
  the experiment file, recorded in the workdir. Nothing is written before every check
  has passed; a workdir that holds another run is refused (flexmarl.runtime.workdir). With
  `config.cluster.backend='ray'` the team's parts start as Ray workers (flexmarl.cluster)
  and this process only drives them.

  Three stages, in order: the spec from the config alone (no device touched); the
  devices (JAX starts, or the Ray cluster does) and the placement on them; the workdir
  and the team.
  """
  quiet_logging()
  malloc.return_freed_memory()
  # Imported here, after absl parsed flags, so XLA_FLAGS set by the caller take effect.
  from flexmarl.runtime import compile_cache
  from flexmarl.build import build_orchestrator
  from flexmarl.core.clock import RealClock
  from flexmarl.config import place_team, team_spec
  from flexmarl.workflows import build_workflow
  from flexmarl.workflows.checks import check_workflow_api

  # 1. The spec: every config section read once, the workflow dry-run; no device yet.
  tokenizers, loaded = load_tokenizers(config)
  workflow = workflow or build_workflow(config.workflow)
  check_workflow_api(workflow)
  spec = team_spec(config, {n: t.vocab_size for n, t in tokenizers.items()},
                   workflow.agent_names())
  for warning in _check_workflow_runs(spec, workflow, tokenizers):
    log(f'warning: {warning}')
  # 2. The devices and the placement on them.
  started = _jax_started()  # then the GPU memory shares cannot be set: JAX read them
  devices, shares, cluster = _start_devices(spec, started)
  try:
    device_ids = [d.id for d in devices] if cluster is None else list(range(cluster.devices))
    spec = place_team(spec, device_ids)
    compile_cache.use(spec.compile_cache_dir)  # before the first step compiles
    if cluster is None:
      spec = _settle_gpu_memory(spec, shares, devices, started, log)
    # 3. The workdir, then the team.
    _accept_workdir(workdir, config, workflow, experiment, loaded, tokenizers, log)
    if cluster is None:
      return build_orchestrator(spec, workflow, tokenizers, workdir, clock=RealClock(),
                                devices=devices)
    from flexmarl.cluster.remote import ray_factories
    orchestrator = build_orchestrator(
        spec, workflow, tokenizers, workdir, clock=RealClock(),
        factories=lambda recorder: ray_factories(spec, tokenizers, workdir, cluster, recorder))
    cluster.wait_started()  # every worker process built its trainer or sampler
  except BaseException:
    if cluster is not None:
      cluster.close()
    raise
  orchestrator.on_close.append(cluster.close)
  cluster.save(workdir)
  log(cluster.describe())
  if spec.rollout.balance:
    log('note: rollout.balance is off under cluster.backend=ray: each instance is a worker '
        'process pinned to its devices, and the balancer does not move workers between '
        'agents yet (each request still goes to its agent\'s least-loaded instance).')
  return orchestrator


def load_tokenizers(config) -> tuple[dict, dict]:
  """({agent: its tokenizer}, {path: tokenizer}): each agent's (`config.tokenizer_paths`:
  its own, its checkpoint's, else the team's), each file loaded once."""
  from flexmarl.config import tokenizer_paths
  from flexmarl.models.tokenizer import load_tokenizer
  paths = tokenizer_paths(config)
  loaded = {path: load_tokenizer(path) for path in {config.tokenizer, *paths.values()}}
  return {name: loaded[path] for name, path in paths.items()}, loaded


def _check_workflow_runs(spec, workflow, tokenizers) -> list[str]:
  """The workflow's dry run (flexmarl.workflows.checks) on a query: its prompts encode and
  fit `max_prompt_len`; a run that evaluates has held-out problems to evaluate on.
  Returns warnings: agents the run's queries cannot serve a global batch."""
  from flexmarl.config import check_prompt_lengths
  from flexmarl.core.errors import ConfigError
  from flexmarl.rollout.held_out import has_held_out
  from flexmarl.metrics.no_update import start_warnings
  from flexmarl.train.credit import check_credit
  from flexmarl.workflows.checks import check_workflow
  episodes: list = []
  requests = check_workflow(workflow, {n: a.group_size for n, a in spec.agents.items()},
                            spec.seed, episodes)
  check_credit(requests, episodes, {n: a.grpo.credit for n, a in spec.agents.items()})
  check_prompt_lengths(requests, tokenizers, spec.max_prompt_len)
  if spec.eval_every and not has_held_out(workflow):
    raise ConfigError(f'config.eval_every={spec.eval_every}: the workflow '
                      f'{type(workflow).__name__} has no held-out problems (an eval_queries() '
                      'method); set eval_every=0 or use a workflow that has them.')
  return start_warnings(requests, {n: a.global_batch for n, a in spec.agents.items()},
                        spec.steps, spec.rollout.max_step_queries)


def _start_devices(spec, started: bool):
  """(this process's JAX devices, the planned GPU memory shares, the Ray cluster or None).
  The shares are set before JAX starts its client (which reads them); a Ray driver owns
  no accelerator."""
  import jax
  from flexmarl.runtime import gpu_memory
  from flexmarl.rollout import backends
  ray = spec.cluster.on_ray
  engines, vllm_given = backends.get(spec.rollout.backend).engine_demand(spec)
  shares = gpu_memory.plan(engines, os.environ, vllm_given)
  if not started:
    if ray:
      os.environ.setdefault('JAX_PLATFORMS', 'cpu')
      jax.config.update('jax_platforms', os.environ['JAX_PLATFORMS'])
    os.environ.update(shares.env())
  devices = jax.devices()
  if not ray:
    return devices, shares, None
  from flexmarl.cluster.ray_cluster import Cluster
  return devices, shares, Cluster(spec.cluster, len(devices))  # numbers the cluster's devices


def _settle_gpu_memory(spec, shares, devices, started: bool, log):
  """On GPUs: the spec with the vLLM engines' planned share of memory, checked to fit."""
  from flexmarl.runtime import gpu_memory
  if devices[0].platform != 'gpu':
    return spec
  log(shares.describe())
  shares.check()
  if started:
    log(f'warning: JAX had started before the run was built, so the planned GPU memory '
        f'shares could not be set; set {gpu_memory.JAX_FRACTION} before JAX starts.')
    return spec
  stats = devices[0].memory_stats() or {}
  if not stats.get('bytes_limit'):
    return spec
  return gpu_memory.settle(spec, shares, int(stats['bytes_limit'] / shares.jax))  # one GPU


def _accept_workdir(workdir, config, workflow, experiment, loaded, tokenizers, log) -> None:
  """Claim the workdir for this run (flexmarl.runtime.workdir) and save the tokenizers beside it:
  the team's in tokenizer/, an agent's own in tokenizers/NAME."""
  from flexmarl.runtime import workdir as workdirs
  from flexmarl.config import default_values
  for warning in workdirs.check_workdir(workdir, config, workflow, experiment,
                                        default_values(config)):
    log(f'warning: {warning}')
  workdirs.accept_workdir(workdir, config, workflow, experiment)
  loaded[config.tokenizer].save(os.path.join(workdir, 'tokenizer'))
  for name, tokenizer in tokenizers.items():
    if tokenizer is not loaded[config.tokenizer]:
      tokenizer.save(os.path.join(workdir, 'tokenizers', name))


def _jax_started() -> bool:
  """Whether a JAX backend has started (it read its memory settings then)."""
  from jax._src import xla_bridge  # no public API says so
  return xla_bridge.backends_are_initialized()


def train(config, workdir: str, workflow=None, log=print, experiment: str | None = None) -> dict:
  """Build the team (see `build`) and run it to `config.steps`; returns the summary.
  On a cluster, a run whose trainer process died resumes from its last checkpoint by
  itself, up to `config.cluster.run_restarts` times."""
  from flexmarl.cluster.remote import WorkerLost
  from flexmarl.spec.cluster import ClusterSpec
  restarts = ClusterSpec.from_config(config.get('cluster')).run_restarts  # checked, defaulted
  for attempt in range(restarts + 1):
    try:
      summary = build(config, workdir, workflow, log, experiment).run(log)
      break
    except WorkerLost as e:
      if attempt == restarts:
        raise
      log(f'warning: {e} Resuming from the last checkpoint in {workdir} (restart '
          f'{attempt + 1} of config.cluster.run_restarts={restarts}).')
  log(format_summary(summary))
  return summary


def format_summary(summary: dict) -> str:
  rows = [f"{'agent':<12} {'accuracy first → last':>24} {'reward first → last':>22} "
          f"{'updates':>8} {'best constant':>14} {'trained/sampled tokens':>23}"]
  for name, s in summary['agents'].items():
    constant = (f"{s['last_best_constant']:>14.2f}" if 'last_best_constant' in s
                else f"{'-':>14}")
    share = (f"{s['trained_tokens']:>8} / {s['generated_tokens']:<7} {s['trained_share']:>4.0%}"
             if 'trained_share' in s else f"{'-':>23}")
    rows.append(f"{name:<12} {s['first_accuracy']:>10.2f} → {s['last_accuracy']:<11.2f} "
                f"{s['first_reward']:>9.2f} → {s['last_reward']:<10.2f} {s['updates']:>8} "
                f"{constant} {share}")
  rows += [f"  {s['no_update']}" for s in summary['agents'].values() if 'no_update' in s]
  for name, e in summary.get('eval', {}).items():
    rows.append(f"{name:<12} held-out greedy accuracy {e['first_accuracy']:.2f} (step "
                f"{e['first_step']}) → {e['last_accuracy']:.2f} (step {e['last_step']})")
  rows.append(f"{summary['steps']} steps in {summary['wall_s']:.0f}s, "
              f"{summary['tokens_per_s']:.0f} generated tokens/s")
  return '\n'.join(rows)
