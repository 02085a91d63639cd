"""Folders and secrets only this user can read or plant files in: the disk tier's.

A folder is created 0700. One that exists already is used only if it is a real folder (not
a link), owned by this user and writable by no one else; one readable by others is
tightened to 0700. Anything else is refused with what to do: a folder under a shared
`--kv-disk-dir` that another local user made first could otherwise feed this worker blocks
or read which prompts it served.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

SECRET_BYTES = 32


class UnsafeFolder(ValueError):
    """A folder (or secret file) someone else owns or may write."""


def own_folder(path: Path) -> Path:
    """`path`, made (0700, parents as needed) or checked as described above."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
        os.chmod(path, 0o700)  # mkdir's mode passes through the umask
        return path
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolder(f"{path} is not a folder (a link or a file): the disk tier uses only a folder it owns")
    if st.st_uid != os.getuid():
        raise UnsafeFolder(f"{path} is owned by uid {st.st_uid}, not this user ({os.getuid()}): another user made it "
                           "first; remove it or choose another --kv-disk-dir")
    if st.st_mode & 0o022:
        raise UnsafeFolder(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): its files could be "
                           "planted; chmod 700 it (and check what is in it) or choose another --kv-disk-dir")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # readable by others: who served what is nobody else's business
    return path


def own_secret(path: Path) -> bytes:
    """The secret kept in file `path` (0600, this user's), made at first use."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        secret = os.urandom(SECRET_BYTES)
        try:
            os.write(fd, secret)
        finally:
            os.close(fd)
        return secret
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise UnsafeFolder(f"{path} is not this user's private file (uid {st.st_uid}, mode "
                               f"{stat.S_IMODE(st.st_mode):04o}): remove it; the disk tier makes a new one")
        secret = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(secret) != SECRET_BYTES:
        raise UnsafeFolder(f"{path} holds {len(secret)} bytes, not a {SECRET_BYTES}-byte secret: remove it")
    return secret
