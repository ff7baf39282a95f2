"""The cluster secret: where it comes from, and how it is checked.

In order: `Security(token=...)`; the variable `KDIST_SECRET` (the secret
itself); the variable `KDIST_SECRET_FILE` (a file holding it on one line, as
`kdist launch` writes one per job with mode 0600); else a secret drawn once
for this process and kept in memory, so that a cluster inside one process works
without configuration and no other process can call it.
"""

import os
import secrets
import threading

from kdist.errors import InvalidArgumentError

SECRET_ENV = "KDIST_SECRET"
SECRET_FILE_ENV = "KDIST_SECRET_FILE"
# Printable ASCII, no spaces: a secret fits on one line of a file or in a variable.
_TOKEN_CHARACTERS = frozenset(chr(code) for code in range(0x21, 0x7F))
# Larger files are not secrets; refusing them early avoids reading a wrongly
# named multi-gigabyte file into memory.
MAX_FILE_BYTES = 1 << 20
_process_secret = None
_process_secret_lock = threading.Lock()


def read_capped(path, what, received, expected):
    """Returns the first `MAX_FILE_BYTES + 1` bytes of a small file (secrets, PEM files).

    Raises:
        kdist.errors.InvalidArgumentError: the file cannot be read; the message
            says "Cannot read {what}", then `received` and `expected`.
    """
    try:
        with open(path, "rb") as file:
            return file.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise InvalidArgumentError(
            f"Cannot read {what}: {error.strerror or error}. Received: {received}. "
            f"Expected {expected}."
        ) from None


def environment_secret(environ=None):
    """Returns the secret `KDIST_SECRET` or `KDIST_SECRET_FILE` gives (a string), or None.

    Args:
        environ: the variables to read (default: `os.environ`).

    Raises:
        kdist.errors.InvalidArgumentError: the variable or the file holds no
            valid secret, or the file cannot be read.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(SECRET_ENV)
    if value:
        _check_token(value, f"the variable {SECRET_ENV}", show=False)
        return value
    path = environ.get(SECRET_FILE_ENV)
    if path:
        return load_token(path)
    return None


def cluster_secret():
    """The cluster secret from the environment, else this process's own (drawn once).

    Raises:
        kdist.errors.InvalidArgumentError: `KDIST_SECRET` or the file named by
            `KDIST_SECRET_FILE` holds no valid secret.
    """
    token = environment_secret()
    if token is not None:
        return token.encode("ascii")
    global _process_secret
    with _process_secret_lock:
        if _process_secret is None:
            _process_secret = secrets.token_bytes(32)
        return _process_secret


def load_token(path):
    """Reads a token from a file; surrounding whitespace (a trailing newline) is dropped.

    Args:
        path: the file holding the token.

    Returns:
        The token, a non-empty printable-ASCII string.

    Raises:
        kdist.errors.InvalidArgumentError: the file cannot be read, or holds no
            valid token.

    Example:

    >>> Security(token=load_token("/etc/kdist/token"))  # doctest: +SKIP
    """
    data = read_capped(path, "the token file", f"path={path!r}", "a readable file holding the token")
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise InvalidArgumentError(
            f"The token file is not ASCII text. Received: path={path!r}. Expected one line of "
            "printable ASCII characters."
        ) from None
    _check_token(token, f"the token in {path!r}", show=False)
    return token


def _check_token(token, name, show=True):
    received = f"{name}={token!r}" if show or not isinstance(token, str) else name
    if not isinstance(token, str) or not token:
        raise InvalidArgumentError(
            f"A token must be a non-empty string. Received: {received}. Expected a shared "
            "secret such as the output of `python -c 'import secrets; "
            "print(secrets.token_urlsafe())'`."
        )
    bad = sorted({character for character in token if character not in _TOKEN_CHARACTERS})
    if bad:
        # Tokens travel as gRPC metadata, which allows printable ASCII only.
        # The message names the offending characters, never the secret itself.
        raise InvalidArgumentError(
            f"A token may contain printable ASCII characters only, no spaces. Received: a token "
            f"in {name} with {len(token)} characters including {''.join(bad)!r}. Expected e.g. "
            "the output of `python -c 'import secrets; print(secrets.token_urlsafe())'`."
        )
