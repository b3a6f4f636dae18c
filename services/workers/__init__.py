"""Background jobs on Celery: recalibration, the nightly golden-set drift check, and the beat
that schedules them. Tasks are thin; the work is in plain functions of settings and a job."""
