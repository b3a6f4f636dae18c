"""Telemetry out of the gateway: the versioned event schema, topics, and a producer that spools
to disk while the broker is unreachable."""
