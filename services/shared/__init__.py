"""What several services use: `build_engine` (the one way to build the engine the settings
configure), the metric-table helper (`metrics_table`) and the small HTTP serving helper
(`serving`). May import `services.config` and `sparse_engine`, no other service package."""
