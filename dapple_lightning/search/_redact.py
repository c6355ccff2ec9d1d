"""Storage URLs shown without their passwords.

An Optuna storage URL may carry a password: in its user part (``postgresql://user:secret@host/db``)
or in a query parameter (``...?password=secret``). The search shows URLs in error messages, hints
and progress lines, and other libraries' errors may quote them; none of that may show the password.
:func:`redact` masks it (``postgresql://user:***@host/db``) in any text, and removes the secrets of
the URLs it is given wherever else they appear. :func:`spells_secret` tells a password written out
from one given by reference (OmegaConf's ``${oc.env:VAR}``, which Hydra saves as written).
"""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["MASK", "cause", "redact", "secrets_of", "spells_secret", "storage_error"]

MASK = "***"

# scheme://user:password@ -- the password up to the token's last "@" (an unencoded "@" in a
# password must not leave its tail visible); never "//" (in optuna://postgresql://u:p@h the
# password belongs to the inner URL).
_USERINFO = re.compile(r"(?P<head>[A-Za-z][\w+.-]*://[^:/\s'\"]*:)(?P<secret>(?!//)[^\s'\"]*)(?=@)")
_QUERY = re.compile(
    r"(?P<head>[?&][^=&#\s'\"]*(?:password|passwd|pwd|secret|token)[^=&#\s'\"]*=)(?P<secret>[^&#\s'\"]*)",
    re.IGNORECASE,
)
_REFERENCE = re.compile(r"\$\{[^}]*\}")


def secrets_of(url: str) -> list[str]:
    """The secrets ``url`` carries (its password, secret query values), as written and decoded."""
    found = [m["secret"] for pattern in (_USERINFO, _QUERY) for m in pattern.finditer(url)]
    return sorted({s for raw in found for s in (raw, unquote(raw)) if s}, key=len, reverse=True)


def redact(text: str, *urls: str | None) -> str:
    """``text`` with every URL's password masked, and the secrets of ``urls`` masked wherever they are.

    >>> redact("cannot open postgresql://dapple:hunter2@db:5432/search")
    'cannot open postgresql://dapple:***@db:5432/search'
    """
    known = [s for url in urls if url for s in secrets_of(url)]
    for secret in sorted(set(known), key=len, reverse=True):
        text = text.replace(secret, MASK)
    for pattern in (_USERINFO, _QUERY):
        text = pattern.sub(lambda m: m["head"] + MASK, text)
    return text


def spells_secret(url: str) -> bool:
    """Whether ``url`` writes a secret out, rather than by an interpolation such as ``${oc.env:VAR}``."""
    return any(_REFERENCE.fullmatch(s) is None for s in secrets_of(url))


def cause(error: BaseException, *urls: str | None) -> BaseException | None:
    """``error`` to chain a redacted message to, or ``None`` when its own text would show a secret."""
    return error if redact(str(error), *urls) == str(error) else None


def storage_error(storage: str, error: BaseException) -> ValueError:
    """The error of a storage that could not be opened, its URL and the cause's text redacted."""
    return ValueError(f"cannot open storage {redact(storage)!r}: {redact(str(error), storage)}")
