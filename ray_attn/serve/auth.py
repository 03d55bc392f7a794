"""Who may use the server: API keys on every route but ``/health``, an admin scope with keys of
its own, and the rule every path an admin route takes must follow.

- **API keys** (``api_keys``, ``api_key_file``, the ``api_key_env`` variable): once any is
  configured, a request must carry ``Authorization: Bearer <key>`` with one of them, else 401
  with our error body and ``WWW-Authenticate: Bearer``.  ``/health`` is always open;
  ``/metrics`` and ``/stats`` are open only with ``public_metrics``.  Every other path -- the
  ``/v1`` routes, ``/tokenize``, ``/docs``, a path that does not exist -- is keyed, so a route
  added later is keyed by default rather than open by omission.
- **Several keys** may be valid at once, so a key can be rotated: add the new one, move the
  clients, drop the old one.  A key file is re-read when it changes (checked at most once a
  second), so that needs no restart.
- **Keys are compared in constant time**: ``hmac.compare_digest`` against every configured key,
  with no early exit on a match, so the answer's timing says nothing about how much of a key
  was right or which key matched.  Keys are never logged and never echoed in an error; the
  config's repr masks them (``SecretStr``).
- **Admin scope** (``/admin/...``): off (404, as a path that does not exist) unless admin keys
  are configured, and then only an admin key opens it -- an API key does not.  Paths an admin
  route takes go through :func:`resolve_under`.

It is an ASGI middleware, placed outside the admission middleware (``admission.py``), so a
request without a valid key is answered before it is counted against any bound and before a
byte of its body is read: a flood of them costs a header lookup each.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from ray_attn.serve.admission import route_path
from ray_attn.serve.app_config import MAX_KEY_CHARS, check_key
from ray_attn.serve.http import HTTPError

log = logging.getLogger("ray.serve")

OPEN_PATHS = frozenset({"/health"})
METRICS_PATHS = frozenset({"/metrics", "/stats"})
ADMIN_PREFIX = "/admin"
# vLLM's adapter routes, kept at their paths for its clients but in the admin scope as their
# /admin/v1/... twins: loading an adapter reads the server's disk.
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
RELOAD_EVERY_S = 1.0


def env_keys(name: Optional[str]) -> list[str]:
    """The comma-separated keys in environment variable ``name`` (none when unset or empty)."""
    raw = os.environ.get(name, "") if name else ""
    return [check_key(k.strip(), f"{name}[{i}]") for i, k in enumerate(raw.split(",")) if k.strip()]


def file_keys(path: str, field: str) -> list[str]:
    """One key per line; blank lines and lines starting with '#' are skipped."""
    keys = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(check_key(line, f"{field} line {n}"))
    return keys


class KeyRing:
    """The keys of one scope, from the config, an environment variable and a file.

    ``configured`` once any source is given; with no key left (the file emptied or unreadable)
    every request is then refused, never let through.  The file is re-read when its size or
    modification time changes, checked at most every ``reload_every_s``."""

    def __init__(self, name: str, keys: Iterable[str] = (), env: Optional[str] = None,
                 file: Optional[str] = None, reload_every_s: float = RELOAD_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.name, self.file, self.reload_every_s, self.clock = name, file, reload_every_s, clock
        self._fixed = tuple(check_key(k, f"{name}[{i}]").encode() for i, k in enumerate(keys))
        self._fixed += tuple(k.encode() for k in env_keys(env))
        self._from_file: tuple[bytes, ...] = ()
        self._stamp: Optional[tuple] = None
        self._checked = clock()
        self._lock = threading.Lock()
        if file:
            try:  # a file named but missing at start is a config error, not an open server
                self._stamp = self._file_stamp()
                self._from_file = tuple(k.encode() for k in file_keys(file, f"{name}_file"))
            except OSError as e:
                raise ValueError(f"{name}_file: cannot read {file!r}: {e.strerror or e}") from None
        self.configured = bool(self._fixed) or bool(file)

    def __repr__(self) -> str:  # never the keys
        return f"KeyRing({self.name}: {len(self.keys())} keys{', file' if self.file else ''})"

    def _file_stamp(self) -> tuple:
        st = os.stat(self.file)
        return st.st_ino, st.st_size, st.st_mtime_ns

    def reload(self) -> None:
        """Re-read the key file now if it changed.  A file that cannot be read or holds a bad
        line leaves no key from it (fail closed) and is logged by name, never by content."""
        if not self.file:
            return
        with self._lock:
            self._checked = self.clock()
            try:
                stamp = self._file_stamp()
                if stamp == self._stamp:
                    return
                keys = tuple(k.encode() for k in file_keys(self.file, f"{self.name}_file"))
            except (OSError, ValueError) as e:
                if self._from_file or self._stamp is not None:
                    log.warning("%s_file %r: %s; none of its keys is accepted until it is readable",
                                self.name, self.file, e if isinstance(e, ValueError) else (e.strerror or e))
                self._from_file, self._stamp = (), None
                return
            if keys != self._from_file:
                log.info("%s_file %r re-read: %d keys", self.name, self.file, len(keys))
            self._from_file, self._stamp = keys, stamp

    def keys(self) -> tuple[bytes, ...]:
        if self.file and self.clock() - self._checked >= self.reload_every_s:
            self.reload()
        return self._fixed + self._from_file

    def accepts(self, credential: Optional[bytes]) -> bool:
        """Whether ``credential`` is one of the keys.  Every key is compared, also after a
        match: the time taken depends only on the number and lengths of the keys."""
        keys = self.keys()
        if credential is None or len(credential) > MAX_KEY_CHARS:
            return False
        ok = False
        for k in keys:
            ok |= hmac.compare_digest(k, credential)
        return ok


def bearer(scope) -> Optional[bytes]:
    """The credential of the request's ``Authorization: Bearer <credential>`` header, byte for
    byte (nothing stripped: ``"Bearer key "`` is not ``key``); None without one, with another
    scheme (``Basic``), with two Authorization headers, or past ``MAX_KEY_CHARS``."""
    found = None
    for k, v in scope.get("headers", ()):
        if k == b"authorization":  # ASGI header names are lower-case
            if found is not None:
                return None  # which one counts would be the server's guess: neither does
            found = v
    if found is None or len(found) > MAX_KEY_CHARS + 16:
        return None
    scheme, sep, credential = found.partition(b" ")
    if not sep or scheme.lower() != b"bearer":  # the scheme is case-insensitive (RFC 9110 11.1)
        return None
    return credential


def unauthorized(scope_name: str, credential: Optional[bytes]) -> HTTPError:
    what = ("required: send Authorization: Bearer <key>" if credential is None
            else "not valid for this server")
    return HTTPError(401, [("authorization", f"authorization: an {scope_name} key is {what}")],
                     {"WWW-Authenticate": "Bearer"})


class Auth:
    """The check every request passes first: ``check(scope)`` is None to let it in, or the
    refusal to send."""

    def __init__(self, api: KeyRing, admin: KeyRing, public_metrics: bool = False,
                 admin_root: Optional[str] = None, on_refused: Optional[Callable[[int], None]] = None):
        self.api, self.admin, self.public_metrics, self.admin_root = api, admin, public_metrics, admin_root
        self.on_refused = on_refused  # the refusal's status, to a metric

    @classmethod
    def from_config(cls, cfg, on_refused: Optional[Callable[[int], None]] = None) -> "Auth":
        """From a ServeAppConfig; env variables and files are read here, in the process that
        serves (the replica, the front), so those keys never travel in the app's config."""
        return cls(KeyRing("api_key", [k.get_secret_value() for k in cfg.api_keys], cfg.api_key_env, cfg.api_key_file),
                   KeyRing("admin_api_key", [k.get_secret_value() for k in cfg.admin_api_keys],
                           cfg.admin_api_key_env, cfg.admin_api_key_file),
                   cfg.public_metrics, cfg.admin_root, on_refused)

    def check(self, scope) -> Optional[HTTPError]:
        path = route_path(scope)
        if path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/") or path in ADMIN_PATHS:
            if not self.admin.configured:  # admin routes are off: they do not exist
                refusal = HTTPError(404, [("path", f"path: {path[:128]} does not exist (admin routes are "
                                                   f"off: no admin_api_key configured)")])
            else:
                credential = bearer(scope)
                refusal = None if self.admin.accepts(credential) else unauthorized("admin", credential)
        elif path in OPEN_PATHS or not self.api.configured or (self.public_metrics and path in METRICS_PATHS):
            return None
        else:
            credential = bearer(scope)
            refusal = None if self.api.accepts(credential) else unauthorized("API", credential)
        if refusal is not None and self.on_refused is not None:
            self.on_refused(refusal.status)
        return refusal

    def admin_path(self, path: str, field: str = "path") -> Path:
        """A path an admin route was given, resolved under ``admin_root`` (:func:`resolve_under`)."""
        if not self.admin_root:
            raise HTTPError(400, [(field, f"{field}: admin routes take no paths: admin_root is not configured")])
        return resolve_under(self.admin_root, path, field)


def resolve_under(root: str, path: str, field: str = "path") -> Path:
    """``path`` (relative to ``root``, or absolute) as the real path it names, which must lie
    strictly under ``root``.  Refused with 400 naming ``field``: a NUL, any ``..`` part (even
    one that would land back inside), and a path that -- through symlinks anywhere on the way,
    the root's own included -- ends outside ``root``.  Callers open the path returned (links
    already followed), not the one given."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise HTTPError(400, [(field, f"{field}: must be a non-empty path without NUL characters")])
    if ".." in Path(path).parts:
        raise HTTPError(400, [(field, f"{field}: '..' is not allowed in a path")])
    base = Path(os.path.realpath(root))
    real = Path(os.path.realpath(base / path))  # an absolute `path` replaces base here
    if real == base or not real.is_relative_to(base):
        raise HTTPError(400, [(field, f"{field}: {path[:200]!r} is not under the admin root")])
    return real


class AuthMiddleware:
    """Refuses, through ``auth_of()`` (the replica's :class:`Auth`; None outside a replica lets
    everything through), every request without the key its path needs."""

    def __init__(self, app, auth_of: Callable[[], Optional[Auth]]):
        self.app, self.auth_of = app, auth_of

    async def __call__(self, scope, receive, send):
        auth = self.auth_of() if scope["type"] == "http" else None
        refusal = auth.check(scope) if auth is not None else None
        if refusal is not None:
            return await refusal.response()(scope, receive, send)
        await self.app(scope, receive, send)


__all__ = ["Auth", "AuthMiddleware", "KeyRing", "MAX_KEY_CHARS", "bearer", "check_key", "resolve_under"]
