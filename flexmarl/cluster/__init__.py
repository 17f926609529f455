"""Running a team over several processes and machines (`config.cluster.backend='ray'`).

The driver process keeps the orchestrator, schedules, rollout engine, balancer, batch
builders, journal and metrics, and owns no accelerator. Each rollout instance is a Ray
actor (`workers.RolloutWorker`) behind the `Sampler` interface; each training mesh is a
trainer group of one Ray actor per process (`workers.TrainerRank`) behind the `Trainer`
interface, its processes one `jax.distributed` cluster. `remote.ray_factories` hands
them to `flexmarl.build.build_team`, so everything past the factories is the code of a
single-process run.
"""
