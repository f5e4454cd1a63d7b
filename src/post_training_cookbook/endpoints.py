"""The one rule for which failures of an OpenAI-compatible endpoint are worth another try,
shared by the cookbook's two clients of such endpoints: hosted evaluation
(``evaluation/hosted.py``) and judge rewards (``envs/judge.py``)."""

from __future__ import annotations

from typing import Any

RETRIED_STATUSES = (408, 409, 429)
"""HTTP statuses retried besides 5xx: a request timeout, a conflict, a rate limit."""


def is_retried(error: Any) -> bool:
    """Whether an ``openai.APIStatusError`` may go away on its own: 408, 409, 429 (a rate
    limit, not a spent quota) and 5xx. Authentication, a spent quota and other 4xx do not."""
    if error.status_code == 429 and getattr(error, "code", None) == "insufficient_quota":
        return False
    return bool(error.status_code in RETRIED_STATUSES or error.status_code >= 500)
