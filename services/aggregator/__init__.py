"""The aggregator: a pure fold of telemetry events into per-(model, level) rolling windows
(`windows`: 5 min, 1 h, 24 h time-bucketed rings) with mergeable latency histograms
(`histograms`). The consumer loop around it polls, folds, persists, then commits offsets."""
