"""SQL storage for the aggregator, alerts and jobs: typed models (`models`), engines, sessions
and migrations (`db`), and the shared reads and writes (`repository`)."""
