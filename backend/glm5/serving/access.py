"""Who may reach which Triton API: the admin key and tritonserver's restricted-API options.

tritonserver serves administrative APIs on the same ports as inference: loading models from the
repository (with ``--model-control-mode=explicit`` a client can upload a ``model.py`` and have it
run), changing log settings, registering shared memory, reading model configs (local paths),
statistics and trace settings (trace files are written where the client says). 2.51 can put each
of these behind a header (``--http-restricted-api`` / ``--grpc-restricted-protocol``); ``glm5
serve`` always does, for the APIs in :data:`RESTRICTED_APIS`, and leaves inference, health and
metadata open.

The key is the operator's (``--admin-key`` or ``$GLM5_ADMIN_KEY``) or, when none is given, a
random one written to a file only the operator's user can read. Logs show where the key is and a
short fingerprint, never the key.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

#: Environment variable holding the admin key (read when ``--admin-key`` is not given).
ADMIN_KEY_ENV = "GLM5_ADMIN_KEY"
#: HTTP header that carries the key. Over gRPC tritonserver expects it as metadata with
#: :data:`GRPC_HEADER_PREFIX` in front (``triton-grpc-protocol-glm5-admin-key``).
ADMIN_HEADER = "glm5-admin-key"
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
#: APIs behind the key: everything a client needs only to administer the server.
RESTRICTED_APIS: tuple[str, ...] = ("model-repository", "model-config", "shared-memory", "logging",
                                    "statistics", "trace")
#: What tritonserver 2.51 accepts as a category; inference, health and metadata stay open here.
KNOWN_APIS = frozenset({"health", "metadata", "inference", *RESTRICTED_APIS})
_MIN_KEY_CHARS = 16


class AccessError(ValueError):
    """An admin key or restricted-API setting is unusable; the message says how to fix it."""


@dataclass(frozen=True)
class AdminKey:
    """The key that unlocks the restricted APIs, and where the operator can read it."""

    value: str
    source: str                 # "flag", "environment" or "generated"
    file: Path | None = None    # where a generated key was written

    @property
    def fingerprint(self) -> str:
        """First 8 hex digits of the key's SHA-256: tells keys apart in logs without revealing one."""
        return hashlib.sha256(self.value.encode()).hexdigest()[:8]

    def http_headers(self) -> dict[str, str]:
        """Headers for an HTTP request to a restricted API."""
        return {ADMIN_HEADER: self.value}

    def grpc_headers(self) -> dict[str, str]:
        """Metadata for a gRPC call to a restricted API (tritonclient ``headers=``)."""
        return {GRPC_HEADER_PREFIX + ADMIN_HEADER: self.value}


def check_key(value: str) -> str:
    """Reject keys that are short or cannot travel in an HTTP header / tritonserver option."""
    if len(value) < _MIN_KEY_CHARS:
        raise AccessError(f"the admin key must have at least {_MIN_KEY_CHARS} characters (got {len(value)}); "
                          f"omit --admin-key/{ADMIN_KEY_ENV} to get a random one")
    bad = sorted({c for c in value if not (c.isascii() and (c.isalnum() or c in "-_.~+/"))})
    if bad:
        raise AccessError(f"the admin key contains {''.join(bad)!r}; use letters, digits and -_.~+/ only")
    return value


def resolve_admin_key(flag_value: str | None, key_file: Path, env: dict[str, str] | None = None) -> AdminKey:
    """The flag's key, else ``$GLM5_ADMIN_KEY``, else a new random key written to ``key_file`` (0600)."""
    env = os.environ if env is None else env
    if flag_value:
        return AdminKey(check_key(flag_value), "flag")
    if env.get(ADMIN_KEY_ENV):
        return AdminKey(check_key(env[ADMIN_KEY_ENV]), "environment")
    value = secrets.token_urlsafe(32)
    key_file = Path(key_file)
    key_file.parent.mkdir(parents=True, exist_ok=True)
    # Created with 0600 from the start: no moment at which another user could read it.
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(key_file, 0o600)
    return AdminKey(value, "generated", key_file)


def parse_api_list(text: str) -> tuple[str, ...]:
    """``"model-repository,logging"`` → a tuple; unknown names are rejected with the valid ones."""
    apis = tuple(a.strip() for a in text.split(",") if a.strip())
    unknown = sorted(set(apis) - KNOWN_APIS)
    if unknown:
        raise AccessError(f"unknown restricted API(s) {unknown}; tritonserver knows {sorted(KNOWN_APIS)}")
    return apis


def restricted_api_args(key: AdminKey, apis: tuple[str, ...] = RESTRICTED_APIS) -> list[str]:
    """tritonserver options that put ``apis`` behind ``key`` on HTTP and gRPC."""
    if not apis:
        return []
    joined = ",".join(apis)
    # Format (2.51 command_line_parser.cc): <apis>:<header>=<value>; gRPC prefixes the header itself.
    return [f"--http-restricted-api={joined}:{ADMIN_HEADER}={key.value}",
            f"--grpc-restricted-protocol={joined}:{ADMIN_HEADER}={key.value}"]
