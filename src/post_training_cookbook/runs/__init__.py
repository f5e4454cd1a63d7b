"""What a run is, below every loop (GRPO's ``grpo/``, SFT's ``sft/``): its folder, checkpoints
and resume (``directory.py``), the checks a resume makes of the folder (``checks.py``), where
a step's metrics go (``reporting.py``), and a model from a run folder (``models.py``)."""
