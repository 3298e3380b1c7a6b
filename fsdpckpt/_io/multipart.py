"""S3 multipart uploads, one request at a time: the storage seam under
:mod:`fsdpckpt._io.spread_remote`, where each rank uploads the parts it owns of a file.

An object written this way is invisible until :meth:`Upload.complete` (given every part's
ETag), and :meth:`Upload.abort` drops every part uploaded so far: a failed save leaves no
object and, once aborted, no storage billed for parts. Parts are at least 5 MiB on S3
(and SeaweedFS, MinIO...) except the last, and at most 10,000 per object
(:func:`part_size`).

Requests go through s3fs (``call_s3``) on the filesystem :func:`~fsdpckpt._io.remote.
location` built, so they have its deadlines (connect and read timeouts, bounded retries:
:mod:`fsdpckpt._io.remote_errors`), and a fault becomes one
:class:`~fsdpckpt.errors.RemoteStorageError` naming the object and what was being done.
Only S3 and stores that speak its API have these calls: other schemes are refused.
"""

from __future__ import annotations

import contextlib
import errno
import io
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fsdpckpt._io.remote import RemotePath
from fsdpckpt._io.remote_errors import remote_error
from fsdpckpt.errors import OptionError, OutputNotWritableError

__all__ = ["PART_SIZE", "MAX_PARTS", "CONCURRENCY", "part_size", "s3_client", "Upload"]

#: The size of every part but the last (tests lower it to S3's minimum, 5 MiB). Bounds what
#: a rank holds of a part it owns while the ranks fill it.
PART_SIZE = 16 << 20
#: S3's limit on the parts of one object.
MAX_PARTS = 10_000
#: Parts of one step uploaded at once by a rank (each a request of its own, in parallel).
CONCURRENCY = 4


def part_size(size: int) -> int:
    """The part size for an object of ``size`` bytes: :data:`PART_SIZE`, doubled until the
    object fits in :data:`MAX_PARTS` parts (a 160 GB file would need more)."""
    part = PART_SIZE
    while -(-size // part) > MAX_PARTS:
        part *= 2
    return part


def s3_client(path: RemotePath) -> Any:
    """The s3fs filesystem under ``path``.

    Raises:
        OptionError: ``path`` is not on S3 (or a store with its API); the message says
            what is supported.
    """
    fs = path.fs
    raw = getattr(fs, "fs", fs)  # under GuardedFS: its own mapping names the wrong object
    if not callable(getattr(raw, "call_s3", None)):
        raise OptionError(
            f"{path}: every rank writing its own bytes of one object needs S3 multipart "
            "uploads, which this store does not offer; write to s3:// (or an S3-compatible "
            "store) or to a local folder every rank shares, then copy it there")
    return raw


class Upload:
    """One multipart upload of the object ``path`` (:meth:`start` it, or rebuild it on
    another rank from the ``upload_id`` rank 0 started)."""

    def __init__(self, path: RemotePath, upload_id: str) -> None:
        self.path, self.upload_id = path, upload_id

    @classmethod
    def start(cls, path: RemotePath) -> Upload:
        """Begin an upload of ``path`` (nothing is visible there yet)."""
        reply = _call(path, "starting an upload of it", "create_multipart_upload")
        return cls(path, str(reply["UploadId"]))

    def part(self, number: int, body: bytes | bytearray) -> str:
        """Upload part ``number`` (from 1); its ETag."""
        reply = _call(self.path, f"uploading part {number} of it", "upload_part",
                      UploadId=self.upload_id, PartNumber=number, Body=_Body(body))
        return str(reply["ETag"])

    def parts(self, bodies: dict[int, bytes | bytearray]) -> dict[int, str]:
        """Upload the parts ``{number: body}``, :data:`CONCURRENCY` at a time; their ETags.
        Returns only once no request is in flight, also when one fails (then it raises
        the first error): an abort after it leaves no part behind."""
        if len(bodies) <= 1:
            return {n: self.part(n, body) for n, body in bodies.items()}
        with ThreadPoolExecutor(min(CONCURRENCY, len(bodies))) as pool:
            futures = {n: pool.submit(self.part, n, body) for n, body in bodies.items()}
        return {n: future.result() for n, future in futures.items()}

    def complete(self, etags: dict[int, str]) -> None:
        """Make the object of parts ``1..len(etags)`` (``{number: ETag}``) appear."""
        parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
        _call(self.path, "completing its upload", "complete_multipart_upload",
              UploadId=self.upload_id, MultipartUpload={"Parts": parts})

    def abort(self) -> None:
        """Drop the upload and every part of it; one already gone is no error."""
        with contextlib.suppress(FileNotFoundError):
            _call(self.path, "aborting its upload", "abort_multipart_upload",
                  UploadId=self.upload_id)


class _Body(io.RawIOBase):
    """A part's buffer as the seekable file botocore streams a body from.

    Given the ``bytearray`` itself, botocore holds two more copies of it while it sends (a
    16 MiB part costs 48 MiB); read from this file in pieces, it holds none (seeking back
    to the start for a retry)."""

    def __init__(self, buffer: bytes | bytearray) -> None:
        super().__init__()
        self._view, self._at = memoryview(buffer).cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), len(self._view) - self._at))
        memoryview(buffer).cast("B")[:count] = self._view[self._at:self._at + count]
        self._at += count
        return count


def _call(path: RemotePath, action: str, method: str, **kwargs: Any) -> Any:
    raw = s3_client(path)
    bucket, key, _ = raw.split_path(path.path)
    try:
        return raw.call_s3(method, Bucket=bucket, Key=key, **kwargs)
    except Exception as exc:
        mapped = remote_error(exc, str(path), action)
        if mapped is not exc:
            raise mapped from exc
        if isinstance(exc, (PermissionError, FileNotFoundError)) and \
                method == "create_multipart_upload":
            code = errno.EACCES if isinstance(exc, PermissionError) else errno.ENOENT
            raise OutputNotWritableError(
                code, f"{path}: {action} failed ({exc}); check the URL, the credentials "
                "and that the bucket exists") from None
        raise
