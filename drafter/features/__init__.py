"""The target's hidden states, what a drafter learns from: the target forward with hooks that
captures the aux states and the teacher (capture), and the shards that store them (store)."""
