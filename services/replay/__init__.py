"""The alert study (`sparseguard eval alerts`): per-request telemetry measured on the real
model (`measure`), replayed on event time through the real fold and evaluator (`replay`), and
judged per rule and per reason (`scoring`, `study`)."""
