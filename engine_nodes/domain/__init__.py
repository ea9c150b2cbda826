"""Pure rules for engine replicas: states, liveness, (later) the performance model."""
