"""Pure rules for usage and cost: minute keys, aggregation, hit rates, prices."""
