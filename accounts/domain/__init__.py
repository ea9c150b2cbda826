"""Pure rules for teams, keys and limits: no Django, no Redis, no HTTP."""
