"""Pure rules for rollouts: stages, allowed steps and (later) guard comparisons."""
