"""Trajectory files: ``rallyrl check``, ``export`` and ``show`` (``commands.py``) over the JSONL the
runner writes (``rollout/output_file.py``); ``export.py`` writes parquet, ``show.py`` prints one."""
