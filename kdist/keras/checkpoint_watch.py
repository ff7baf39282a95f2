"""Which checkpoints in a directory are new and stable: the polling half of `SidecarEvaluator`.

- **Identity**: `(path, mtime_ns, size)`; a file rewritten at the same path is
  a new checkpoint.
- **Stable**: an identity that did not change between two polls. kdist's chief
  replaces files atomically (`kdist.atomic_files`), but other writers (plain
  Keras, user code) may write in place, so only stable files are reported.
- **Finished**: an identity its owner has dealt with (evaluated, or given up
  on); it is not reported again unless the file changes.

Not thread-safe: one evaluator's thread polls.
"""

import fnmatch
import os

EVALUATION_SUFFIX = ".eval.json"

# Names starting with "." are temporary files: kdist's chief and the evaluator
# write `.kdist-tmp-<pid>-<random>-<name>` and rename it into place (`kdist.atomic_files`).
_HIDDEN_PREFIX = "."


def identity_of(path):
    """`(path, mtime_ns, size)` of the file at `path` now, or None when it is gone."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return (path, stat.st_mtime_ns, stat.st_size)


class CheckpointWatch:
    """Polls `directory` for files matching `patterns` and reports the stable, unfinished ones.

    Args:
        directory: the checkpoint directory (it may not exist yet).
        patterns: a tuple of `fnmatch` globs such as `("*.keras",)`.
    """

    def __init__(self, directory, patterns):
        self.directory = directory
        self.patterns = tuple(patterns)
        self._poll_count = 0
        # path -> (identity, poll it was first seen with that identity)
        self._sightings = {}
        # path -> identity last evaluated or skipped there (older ones are gone from disk)
        self._finished = {}

    def finish(self, identity):
        """Stops reporting `identity` (until its file changes)."""
        self._finished[identity[0]] = identity

    def poll(self):
        """Looks at the directory once.

        Returns:
            `(stable, news)`: identities that are stable and not yet finished, oldest
            first; and whether an unfinished identity appeared since the last poll.
        """
        self._poll_count += 1
        current = {}
        for path in self._checkpoint_paths():
            identity = identity_of(path)
            if identity is not None:  # None: deleted between listing and stat.
                current[path] = identity
        news = False
        stable = []
        for path, identity in current.items():
            if self._finished.get(path) == identity:
                continue
            seen = self._sightings.get(path)
            if seen is None or seen[0] != identity:
                self._sightings[path] = (identity, self._poll_count)
                news = True
            elif seen[1] < self._poll_count:
                stable.append(identity)
        for path in list(self._sightings):
            if path not in current:
                del self._sightings[path]
        stable.sort(key=lambda identity: (identity[1], identity[0]))
        return stable, news

    def _checkpoint_paths(self):
        try:
            entries = list(os.scandir(self.directory))
        except (FileNotFoundError, NotADirectoryError):
            return []  # Not made yet: the chief creates it with its first checkpoint.
        paths = []
        for entry in entries:
            name = entry.name
            if name.startswith(_HIDDEN_PREFIX) or name.endswith(EVALUATION_SUFFIX):
                continue
            if not any(fnmatch.fnmatch(name, pattern) for pattern in self.patterns):
                continue
            try:
                if not entry.is_file():
                    continue
            except OSError:
                continue
            paths.append(entry.path)
        return sorted(paths)
