"""The full spec's scheduler side: vLLM's manager contract over kvtier's
hierarchy (:mod:`~kvtier.connector.scheduler.manager`) and the runtime that
executes the hierarchy's spill orders off the scheduler's critical path
(:mod:`~kvtier.connector.scheduler.disk_runtime`)."""
