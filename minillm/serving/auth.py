"""API keys: who is calling (chapter 10.1's first gateway stage). Keys are compared in constant time
by their digests; the admin key reads every caller's traces and the engine's steps."""
from __future__ import annotations

import hashlib
import hmac
import os
from typing import Iterable, Mapping

from minillm.serving.errors import GatewayError

# ---------------------------------------------------------------------------------------------
# Authentication: API keys
# ---------------------------------------------------------------------------------------------

ANONYMOUS = "anonymous"
ADMIN = "admin"      # the admin key's id: it reads every caller's traces and the engine's steps


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _split_keys(values: Iterable[str]) -> list[str]:
    out: list[str] = []
    for value in values:
        for key in value.split(","):
            key = key.strip()
            if key and key not in out:
                out.append(key)
    return out


def keys_from_env_and_args(arg_keys: str | Iterable[str] | None = None,
                           env: Mapping[str, str] | None = None) -> list[str]:
    """API keys from ``--api-key`` arguments plus the ``MINILLM_API_KEY`` environment variable.

    Both may hold several comma-separated keys; blanks are dropped and duplicates removed, so an
    empty ``MINILLM_API_KEY=`` means "no key from the environment", not "the empty key".
    An environment variable is the better place for a secret: command lines are visible to every
    user of the machine in ``ps``.
    """
    env = os.environ if env is None else env
    if isinstance(arg_keys, str):
        arg_keys = [arg_keys]
    return _split_keys([*(arg_keys or []), env.get("MINILLM_API_KEY", "")])


class APIKeyAuth:
    """Bearer-token authentication against a fixed set of API keys.

    Only SHA-256 digests of the keys are kept, so neither ``repr`` nor a debugger nor a crash
    dump of this object shows a key. With no keys configured the gateway is open (a local
    notebook needs no key) and every caller is ``"anonymous"``.

    A caller is known by a *key id*: ``key-1``, ``key-2``, … in the order the keys were given,
    and ``admin`` for the optional admin key. The id says nothing about the key itself (an
    earlier version used a hash prefix, which let anyone who saw it test guesses offline).
    """

    def __init__(self, keys: Iterable[str] | None = None, admin_key: str | None = None) -> None:
        keys = list(keys or [])
        if any(not isinstance(k, str) or not k.strip() for k in keys) or (
                admin_key is not None and (not isinstance(admin_key, str) or not admin_key.strip())):
            # An empty key would make "Authorization: Bearer " valid: refuse to start instead.
            raise ValueError("API keys must be non-empty strings")
        self._entries: list[tuple[bytes, str]] = []   # (sha256 digest, key id)
        for i, k in enumerate(dict.fromkeys(k.strip() for k in keys), start=1):
            self._entries.append((_digest(k), f"key-{i}"))
        if admin_key is not None:
            if any(d == _digest(admin_key.strip()) for d, _ in self._entries):
                raise ValueError("the admin key must differ from every API key")
            self._entries.append((_digest(admin_key.strip()), ADMIN))

    @property
    def open(self) -> bool:
        """True when no keys are configured: every request is accepted as ``anonymous``."""
        return not self._entries

    @property
    def key_ids(self) -> list[str]:
        return [kid for _, kid in self._entries]

    @property
    def has_admin(self) -> bool:
        return ADMIN in self.key_ids

    def check(self, authorization_header: str | None) -> str:
        """Return the caller's key id, or raise 401.

        The header must be ``Bearer <key>``. The presented key is compared with *every*
        configured key using :func:`hmac.compare_digest` on SHA-256 digests, and the loop never
        exits early: the time taken then reveals neither how many leading characters matched
        (a plain ``==`` stops at the first difference), nor the key's length (digests all have
        32 bytes), nor which of the keys matched.
        """
        if self.open:
            return ANONYMOUS
        if not authorization_header or not authorization_header.strip():
            raise GatewayError(401, "invalid_api_key",
                               "Missing API key: send an 'Authorization: Bearer <key>' header.")
        # Never echo the header back: it may be a real key sent in the wrong format.
        parts = authorization_header.strip().split(None, 1)
        if len(parts) != 2 or parts[0].lower() != "bearer" or not parts[1].strip():
            raise GatewayError(401, "invalid_api_key",
                               "Malformed Authorization header: expected 'Bearer <key>'.")
        presented = _digest(parts[1].strip())
        matched: str | None = None
        for digest, key_id in self._entries:
            if hmac.compare_digest(digest, presented) and matched is None:
                matched = key_id
        if matched is None:
            raise GatewayError(401, "invalid_api_key", "Incorrect API key provided.")
        return matched

    def __repr__(self) -> str:
        if self.open:
            return "APIKeyAuth(open)"
        return f"APIKeyAuth({len(self._entries)} key(s): {', '.join(self.key_ids)})"
