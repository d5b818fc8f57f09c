"""Which browsers' requests the server answers: the defences local servers adopted after DNS-rebinding and
cross-origin reports (a web page POSTing to http://127.0.0.1:8000 from the user's browser).

- Host. A page on evil.example can rebind its name to 127.0.0.1; the browser then sends `Host:
  evil.example` to the local server and lets the page read the answer. A server bound to a loopback
  address therefore answers only loopback names (localhost, *.localhost, 127.0.0.0/8, ::1) and the names
  in --allowed-hosts ("*": any). Bound elsewhere, it checks Host only against --allowed-hosts, if given.
- Origin. Browsers send Origin with cross-origin requests; no page is served from here, so a request
  with an Origin is refused unless --allowed-origins lists it ("*": any), and only listed origins get
  CORS headers (and answers to their preflights).
- Content-Type. A page may POST text/plain cross-origin with no preflight; POST bodies must be
  application/json, which a page can send only after a preflight the Origin rule refuses.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from redline.server.errors import APIError

LOOPBACK_NAMES = ("localhost",)
HOST = re.compile(r"(?:\[([0-9a-f:.]+)\]|([a-z0-9_.-]+))(?::[0-9]{1,5})?")  # [IPv6] or name, then :port


def is_loopback(host: str) -> bool:
    """True for "localhost", "api.localhost", "127.0.0.5", "::1"; False for "0.0.0.0", "evil.example"."""
    host = host.lower().rstrip(".")
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:80" -> "::1",
    "Example.COM" -> "example.com"; "" (allowed nowhere) for anything not a name or address and an
    optional port: "localhost:80@evil", "[::1]evil", "localhost:"."""
    match = HOST.fullmatch(header.strip().lower())
    return "" if match is None else match.group(1) or match.group(2)


@dataclass(frozen=True)
class WebPolicy:
    loopback_only: bool = True  # bound to a loopback address: foreign Host names are refused
    allowed_hosts: tuple[str, ...] = ()  # more Host names ("*": any)
    allowed_origins: tuple[str, ...] = ()  # origins answered, with CORS headers ("*": any)

    @classmethod
    def for_bind(cls, bind_host: str, hosts: Iterable[str] = (), origins: Iterable[str] = ()) -> WebPolicy:
        """The policy of a server listening on bind_host ("127.0.0.1", "0.0.0.0", ...)."""
        hosts = tuple(host_name(h) if h != "*" else h for h in hosts)
        return cls(is_loopback(bind_host), hosts, tuple(o.rstrip("/") for o in origins))

    def host_allowed(self, header: str | None) -> bool:
        """Host header absent (HTTP/1.0): allowed; a browser always sends one."""
        if header is None or "*" in self.allowed_hosts:
            return True
        name = host_name(header)
        if name in self.allowed_hosts:
            return True
        if self.loopback_only:
            return is_loopback(name)
        return not self.allowed_hosts  # bound elsewhere: checked only against a list that was given

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.rstrip("/") in self.allowed_origins

    def refusal(self, method: str, host: str | None, origin: str | None, content_type: str | None
                ) -> APIError | None:  # fmt: skip
        """Why a request is refused before it reaches the API (403, 415), or None."""
        if not self.host_allowed(host):
            if self.loopback_only:
                message = f"Host {host!r} is not allowed: this server answers loopback names"
                message += "; --allowed-hosts adds names"
            else:
                message = f"Host {host!r} is not one of the allowed hosts (--allowed-hosts)"
            return APIError(403, message, kind="permission_error", reason="host")
        if origin is not None and not self.origin_allowed(origin):
            message = f"Origin {origin!r} is not allowed (--allowed-origins lists the web origins answered)"
            return APIError(403, message, kind="permission_error", reason="origin")
        if method == "POST" and not _is_json(content_type):
            message = f"Content-Type {content_type!r}: request bodies must be application/json"
            return APIError(415, message, reason="not_json")
        return None


def _is_json(content_type: str | None) -> bool:
    """True for "application/json" and "application/json; charset=utf-8"; False for "text/plain", None."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"
