"""The gateway's routers, one per resource: `chat` (OpenAI chat completions and Anthropic
messages), `system` (models, health, readiness, metrics), `admin` (engine status,
recalibration jobs) and `status` (the status page and its data)."""
