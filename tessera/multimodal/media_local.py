"""Local media files: read only under --allowed-local-media-path (or anywhere in the offline Engine's
trusted mode), after resolving links and '..', never blocking on a FIFO or device, never past the byte cap.
"""

from __future__ import annotations

import os
import stat
import urllib.parse

from tessera.messages.items import Modality
from tessera.multimodal.media_limits import (
    MediaError,
    MediaLimits,
    check_size,
    parse_url,
)


def file_uri_path(uri: str) -> str:
    parsed = parse_url(uri)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"file URI with a remote host {parsed.netloc!r} is not supported")
    return urllib.parse.unquote(parsed.path)


def _resolve_allowed(path: str, limits: MediaLimits) -> str:
    """The real path of `path` if policy allows reading it; raises MediaError otherwise."""
    if limits.allowed_local_media_path is None and not limits.allow_any_local_path:
        raise MediaError("local media files are not allowed; start the server with --allowed-local-media-path DIR "
                         "(Engine: allowed_local_media_path=DIR) to allow the files under DIR")
    try:
        root = None if limits.allow_any_local_path else os.path.realpath(limits.allowed_local_media_path or "/")
        # realpath resolves symlinks and '..' so a link inside the root cannot escape it.
        real = os.path.realpath(os.path.expanduser(path))
    except (ValueError, OSError) as e:  # e.g. embedded NUL byte
        raise MediaError(f"invalid local media path: {e}") from e
    if root is not None:
        if os.path.commonpath([real, root]) != root:
            raise MediaError(f"local media path {path!r} is outside the allowed directory "
                             f"(--allowed-local-media-path)")
    return real


def local_file_allowed(path: str, limits: MediaLimits) -> bool:
    try:
        return os.path.isfile(_resolve_allowed(path, limits))
    except MediaError:
        return False


def read_local_file(path: str, *, modality: Modality, limits: MediaLimits) -> bytes:
    real = _resolve_allowed(path, limits)
    cap = limits.max_bytes_for(modality)
    if not os.path.exists(real):
        raise MediaError(f"local media file {path!r} does not exist")
    if not os.path.isfile(real):  # directories, FIFOs (a read would block), devices
        raise MediaError(f"local media path {path!r} is not a regular file")
    try:
        # O_NOFOLLOW: the final component was resolved above; refuse if it became a link since.
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise MediaError(f"cannot open local media file {path!r}: {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise MediaError(f"local media path {path!r} is not a regular file")
        check_size(os.fstat(f.fileno()).st_size, cap, modality, "file")
        try:
            data = f.read(cap + 1)
        except OSError as e:
            raise MediaError(f"cannot read local media file {path!r}: {e.strerror}") from e
    check_size(len(data), cap, modality, "file")
    return data
