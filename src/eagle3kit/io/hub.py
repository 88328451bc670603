"""Hub ids and downloads: one rule for what a Hub id is, one way to fetch from the Hub.

Every command that accepts "a directory or a Hub id" (targets, drafts, tokenizers) goes
through here, so a typo in a local path and an unreachable Hub both read as one line that says
which it was, in seconds, instead of minutes of retry messages.
"""

from __future__ import annotations

import functools
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from eagle3kit.errors import InputError, first_line

# ORG/NAME as the Hub allows them: both parts start with a letter or digit.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def is_hub_id(spec: str) -> bool:
    """`spec` has the shape of a Hub id and is not a local path."""
    return bool(HUB_ID.match(spec)) and not Path(spec).expanduser().exists()


@functools.cache
def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub endpoint accepts a TCP connection (False under HF_HUB_OFFLINE)."""
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def snapshot(repo_id: str, patterns: list[str], what: str) -> Path:
    """The files of `repo_id` matching `patterns`, from the Hub or, offline, from its cache.

    `what` names the thing for the error ("the draft", "the target"). A Hub that cannot be
    reached is checked once, in seconds, then only the local cache is consulted.
    """
    import logging

    from huggingface_hub import snapshot_download

    online = hub_reachable()
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its retry warnings are pages; we say it in one line
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns,
                                      local_files_only=not online))
    except Exception as e:  # network, auth, missing repo: one clear line
        if not online:
            raise InputError(f"no such directory, and {what} is not in the local Hub cache; "
                             "the Hub cannot be reached from here (no network, or "
                             "HF_HUB_OFFLINE is set)", path=repo_id) from None
        raise InputError(f"no such directory, and {what} cannot be downloaded from the Hub "
                         f"({type(e).__name__}: {first_line(e)})", path=repo_id) from None
    finally:
        hub_log.setLevel(level)
