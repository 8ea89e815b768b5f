"""dropless.monitor: routing health (stats on the device, alarms, plots, the diagnose report).

See docs/monitoring.md for the files a run writes and how the trainer calls in.
"""
