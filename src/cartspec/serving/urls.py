"""Endpoint URLs as they may be shown: in ``/health``, ``/metrics``, ``/v1/info``, logs, traces, records and errors.

A URL can carry a credential: ``https://user:token@host/`` (userinfo) or ``?api_key=...`` (a query parameter).
``redact_url`` keeps what tells endpoints apart (scheme, host, port, path) and masks both, so that one function
decides what of an endpoint's address ever leaves the process. Requests still go to the URL as given.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

MASK = "***"


def redact_url(url: str) -> str:
    """``url`` without credentials: userinfo becomes ``***@``, every query value ``***`` (a bare parameter,
    which may be a token itself, ``***``), and the fragment is dropped."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced IPv6 bracket: show nothing of it rather than all of it
        return "<unparsable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rpartition('@')[2]}"
    query = "&".join(f"{name}={MASK}" if sep else MASK
                     for name, sep, _ in (p.partition("=") for p in parts.query.split("&") if p))
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
