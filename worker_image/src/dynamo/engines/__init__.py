"""Engines served by `dynamo-worker`: the reference Transformers engine and the sample engine."""
