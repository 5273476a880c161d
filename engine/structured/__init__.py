"""Structured outputs: a request's output held to a JSON schema, a regex, a choice of strings or
a grammar, by masking the tokens its grammar does not allow at each sampled position
(llguidance computes the masks; spec.py, matcher.py)."""
