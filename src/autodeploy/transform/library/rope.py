"""pattern_matcher stage: rope matchers (in progress)."""
