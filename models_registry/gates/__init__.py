"""The version gates that run outside a request: the eval gate and the load test."""
