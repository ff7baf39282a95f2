"""The per-job secret that `kdist launch` hands to the tasks it starts.

Every launch makes a fresh secret, writes it to a file that only this user can
read (mode 0600, in a directory of mode 0700), and gives each child the file's
path in `KDIST_SECRET_FILE`. The secret itself is never on a command line
(`/proc/<pid>/cmdline` is readable by every local user) nor in a child's
environment. The servers and clients of the job read it through
`kdist.rpc.security` and prove to each other that they hold it.

A user who set `KDIST_SECRET_FILE` or `KDIST_SECRET` (one secret for a whole
multi-host cluster) keeps it: the children inherit it and nothing is made.

Imports no framework and no gRPC: the launcher must start at once.
"""

import os
import secrets
import shutil
import tempfile

# The names `kdist.rpc.security` reads; defined here too so that the launcher
# does not import the gRPC side.
SECRET_FILE_VARIABLE = "KDIST_SECRET_FILE"
SECRET_VARIABLE = "KDIST_SECRET"
# 32 random bytes, 43 URL-safe characters.
SECRET_BYTES = 32
SECRET_FILE_NAME = "secret"


class JobSecret:
    """A secret file for one launch, removed by `close` (or leaving the with-block).

    Not thread-safe; the launcher makes and removes it in its main thread.

    Attributes:
        path: the file holding the secret (one line), or None when the user's own
            `KDIST_SECRET_FILE`/`KDIST_SECRET` is passed through.
        env: the variables to set in every child (empty when passed through).

    Example:
        ```python
        with JobSecret.create(os.environ) as secret:
            specs = [dataclasses.replace(s, env={**s.env, **secret.env}) for s in specs]
            ...  # run the job
        ```
    """

    def __init__(self, directory, path):
        self._directory = directory
        self.path = path
        self.env = {} if path is None else {SECRET_FILE_VARIABLE: path}

    @classmethod
    def create(cls, environ):
        """Makes a fresh secret file, unless `environ` already names a secret.

        Args:
            environ: the launcher's environment (`os.environ`).

        Raises:
            OSError: the temporary directory cannot be written.
        """
        if environ.get(SECRET_FILE_VARIABLE) or environ.get(SECRET_VARIABLE):
            return cls(None, None)
        directory = tempfile.mkdtemp(prefix="kdist-secret-")  # Mode 0700.
        try:
            path = os.path.join(directory, SECRET_FILE_NAME)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w", encoding="ascii") as file:
                file.write(secrets.token_urlsafe(SECRET_BYTES) + "\n")
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return cls(directory, path)

    @property
    def generated(self):
        """True when this launch made the secret (False: the user's is passed through)."""
        return self.path is not None

    def close(self):
        """Removes the secret's directory; a second call does nothing."""
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False
