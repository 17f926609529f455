"""Experience storage: per-agent tables of sampled turns, shared by rollout and training."""
