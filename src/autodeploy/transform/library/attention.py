"""pattern_matcher stage: attention matchers (in progress)."""
