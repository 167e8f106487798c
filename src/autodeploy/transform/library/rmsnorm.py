"""pattern_matcher stage: rmsnorm matchers (in progress)."""
