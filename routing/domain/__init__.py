"""Pure routing decisions: tiers, (later) the hash ring, policies, buckets, admission."""
