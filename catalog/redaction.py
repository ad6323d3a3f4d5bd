"""What no message, log line or stored error may show: the user and password in a URL; and secrets as the
environment gives them.

Shared by every layer that prints a URL a person gave (scrape targets, the fleet file's values).
"""

from __future__ import annotations

import re

__all__ = ["env_secret", "without_credentials"]

# `scheme://user:pass@host`, up to the last `@` before the path, so a password with an `@` in it is hidden whole.
_USERINFO = re.compile(r"(?<=://)[^/?#\s]*@")


def without_credentials(text: str) -> str:
    """`text` with the user and password of every URL in it hidden."""
    return _USERINFO.sub("***@", text)


def env_secret(value: str | None) -> str | None:
    """A token as the environment holds it, without the surrounding whitespace (a Kubernetes Secret made from a file
    ends in a newline no HTTP client can send); None when empty or unset."""
    return (value or "").strip() or None
