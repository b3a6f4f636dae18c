"""The alert rule library, pure: rules from YAML (`rules`), their conditions and the stateful
evaluator (`conditions`, `evaluator`), notification payloads and signing (`payload`,
`signing`), and the Prometheus rule export (`prometheus`, given the series map). Imports no
SparseGuard service; storage-backed delivery lives in `services.alerting`."""
