"""What a run reports.

- :mod:`.tracking`: ``summary.json``, wandb and the progress display.
- :mod:`.timeline`: the run's timeline as a CSV, a plot and recovery numbers.
- :mod:`.tee`: a process's console copied into ``logs/``.
"""
