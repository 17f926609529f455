"""The specs of a run: each part's config section read, defaulted and checked once (agents, cluster, the team), before anything starts."""
