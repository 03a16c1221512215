"""Structured output: outputs that follow a JSON schema, a regex, a list of choices or a
grammar (params.py: what a request asks; backend.py: the grammar library; manager.py: builds,
matchers and masks of one rank; metrics.py: its counters)."""
