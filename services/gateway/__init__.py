"""The HTTP gateway: the app (`app`), its routers (`routes/`), the request pipeline (`pipeline`:
hygiene, policy, the engine thread or the upstream API, trust and fallback), response formats,
telemetry events and the calibration listener that hot-reloads new versions."""
