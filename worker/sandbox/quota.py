"""A run folder's disk quota (``policy.max_disk_mb``): ``RLIMIT_FSIZE`` bounds one file,
this bounds the folder (its ``.tmp`` included).

No kernel quota works in every deployment (project or group quotas need a filesystem
mounted for them; a size-limited mount needs ``CAP_SYS_ADMIN``, which Docker's default
profile drops), so the worker counts what the folder holds (allocated blocks):

- before a call: a call's ``RLIMIT_FSIZE`` is at most what is left, so one file cannot
  take the folder past its quota; a folder already over it gets calls with
  ``RLIMIT_FSIZE`` 0: they can still read, list and delete, not grow a file;
- while a call runs, every ``QUOTA_TICK_S``: a call that took the folder past its
  quota (many files) is killed, ``DiskQuota: ...``. Overshoot: what one call writes in
  one tick.

A subfolder the worker cannot read (a non-root worker, a call that did ``chmod 000``) is
counted as over the quota: what cannot be counted is not given more room.
"""

from __future__ import annotations

import os

QUOTA_TICK_S = 1.0  # between two counts while a call runs (the first one after this long)


def usage(path: str, stop: int) -> int:
    """Bytes allocated under ``path``; the count stops once it is over ``stop`` (a folder
    of 10 000 files costs ~10 ms; the usual run folder, tens of microseconds)."""
    total, folders = 0, [path]
    while folders:
        folder = folders.pop()
        try:
            entries = os.scandir(folder)
        except FileNotFoundError:
            continue
        except OSError:
            return stop + 1  # cannot be counted: no more room
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                total += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
                if total > stop:
                    return total
    return total


def room(path: str, quota: int) -> int:
    """What a call may still write into the run's folder (0 when it is over its quota)."""
    return max(0, quota - usage(path, quota))


def over_message(path: str, quota: int) -> str | None:
    """Why a running call is stopped, or None while the folder is within its quota."""
    used = usage(path, quota)
    if used <= quota:
        return None
    return (f"DiskQuota: the run's folder holds more than its quota of {quota >> 20} MiB "
            "(sandbox.max_disk_mb); delete files to go on")  # fmt: skip
