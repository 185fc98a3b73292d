"""Whether this process's Hugging Face Hub lookups can reach the Hub (imports nothing of fv_accel)."""

from __future__ import annotations

import os
from typing import Optional

# Why this process looks in the local cache only although HF_HUB_OFFLINE is not set (the Hub did
# not answer), once `offline_unless_hub_answers` has asked; None while the Hub is used.
_UNREACHABLE: Optional[str] = None
_HUB_ASKED = False
HUB_PROBE_TIMEOUT_S = 5.0


def offline_unless_hub_answers() -> bool:
    """Whether Hub lookups are local only: HF_HUB_OFFLINE is set, or the Hub endpoint does not
    answer one request (no network, a refused connection). huggingface_hub would otherwise retry
    each file 5 times over half a minute; without an answer this process turns offline
    (HF_HUB_OFFLINE for itself and the libraries it loads models with), so a model missing from the
    cache is one line with the `hf download` hint. Asked once per process."""
    global _UNREACHABLE, _HUB_ASKED
    if hub_offline():
        return True
    if not _HUB_ASKED:
        _HUB_ASKED = True
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session

        try:
            get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - any transport error: no answer
            _UNREACHABLE = f"the Hub ({constants.ENDPOINT}) does not answer ({error_first_line(err)})"
            os.environ["HF_HUB_OFFLINE"] = "1"
            constants.HF_HUB_OFFLINE = True
    return _UNREACHABLE is not None


def unreachable_reason() -> Optional[str]:
    """Why Hub lookups are local only although HF_HUB_OFFLINE was not set; None otherwise."""
    return _UNREACHABLE


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub sees it (its constant is read at import time)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return bool(constants.HF_HUB_OFFLINE) or env


def error_first_line(err: Exception) -> str:
    """`ClassName: first line of the message`, for a one-line error."""
    text = str(err).strip()
    return f"{err.__class__.__name__}: {text.splitlines()[0] if text else ''}"
