"""The batch tier's execution: Celery tasks that validate batches, run their lines through the
interactive request pipeline at batch priority and prices, and finalize their output files."""
