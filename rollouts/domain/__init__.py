"""Pure rules for rollouts: stages, plans and their state machine, guard comparisons."""
