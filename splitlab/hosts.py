"""Facts about host address strings, shared by the wire (where a socket binds) and analysis
(whether a traced link left the machine). Pure: no socket is opened.

    .venv/bin/pytest tests/unit/test_analysis_links.py -q -k loopback
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str | None) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (with or without a port or brackets)."""
    if not host:
        return False
    name = host.strip().lower()
    if name.startswith("["):  # [::1]:5000
        name = name[1:].split("]", 1)[0]
    elif name.count(":") == 1:  # 127.0.0.1:5000 or localhost:5000
        name = name.split(":", 1)[0]
    if name in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
