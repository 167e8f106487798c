"""pattern_matcher stage: moe matchers (in progress)."""
