"""The data the project ships, and reading data files safely, shipped or a user's own.

Owns this folder: public traces, performance profiles and metric fixtures (sources and licenses
in `NOTICE.md`), each listed with its SHA-256 in `SHA256SUMS`. Every read of a file in this folder
is checked against that manifest first, so a damaged install fails with a line naming the file
instead of replaying wrong numbers. Files named `*.gz` are decompressed on the fly, for shipped
and user files alike; every failure (missing, truncated, not gzip, not UTF-8) becomes a
`DataError` that names the file.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from controlplane.errors import DataError

__all__ = ["DATA_DIR", "MANIFEST", "read_bytes", "read_lines", "read_text", "shipped", "verify"]

DATA_DIR = Path(__file__).resolve().parent
MANIFEST = DATA_DIR / "SHA256SUMS"

_verified: dict[Path, tuple[int, int]] = {}  # path -> (size, mtime_ns) when it last matched
_manifest: dict[str, str] | None = None


def _load_manifest() -> dict[str, str]:
    global _manifest
    if _manifest is None:
        entries: dict[str, str] = {}
        try:
            text = MANIFEST.read_text(encoding="utf-8")
        except OSError as exc:
            raise DataError(MANIFEST, f"cannot read the checksum manifest ({exc.strerror or exc})") from None
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            digest, sep, name = line.partition("  ")
            if not sep or len(digest) != 64:
                raise DataError(MANIFEST, "expected '<sha256>  <path>'", n)
            entries[name.strip()] = digest
        _manifest = entries
    return _manifest


def _relative(path: Path) -> str | None:
    """`path` relative to the data folder, or None when it lies outside it."""
    try:
        return path.resolve().relative_to(DATA_DIR).as_posix()
    except ValueError:
        return None


def verify(path: Path | str) -> None:
    """Check a file of the data folder against the manifest; files elsewhere pass unchecked."""
    path = Path(path)
    rel = _relative(path)
    if rel is None:
        return
    try:
        st = path.stat()
    except OSError as exc:
        raise DataError(path, f"cannot read the shipped file ({exc.strerror or exc}); reinstall the package") from None
    if _verified.get(path) == (st.st_size, st.st_mtime_ns):
        return
    expected = _load_manifest().get(rel)
    if expected is None:
        raise DataError(path, f"not in the shipped manifest {MANIFEST.name}")
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != expected:
        raise DataError(path, f"checksum mismatch: the shipped file was changed or damaged "
                              f"(sha256 {actual[:16]}..., expected {expected[:16]}...); reinstall the package")
    _verified[path] = (st.st_size, st.st_mtime_ns)


def shipped(relative: str) -> Path:
    """The verified path of a shipped file, e.g. `traces/mooncake/conversation_trace.jsonl.gz`."""
    path = DATA_DIR / relative
    if not path.is_file():
        raise DataError(path, "no such shipped file; reinstall the package")
    verify(path)
    return path


def _opened(path: Path) -> IO[bytes]:
    verify(path)
    try:
        # gzip.open owns the file it opens, so closing the reader closes it too.
        opened: IO[bytes] = gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb")  # type: ignore[assignment]
        return opened
    except FileNotFoundError:
        raise DataError(path, "no such file") from None
    except IsADirectoryError:
        raise DataError(path, "is a folder, not a file") from None
    except OSError as exc:
        raise DataError(path, f"cannot open ({exc.strerror or exc})") from None


def _decompression_error(path: Path, exc: Exception) -> DataError:
    if isinstance(exc, EOFError):
        return DataError(path, "truncated: the compressed stream ends early")
    if isinstance(exc, gzip.BadGzipFile):
        return DataError(path, f"not a gzip file ({exc})")
    return DataError(path, f"damaged compressed data ({exc})")


_DECOMPRESSION = (EOFError, gzip.BadGzipFile, zlib.error)


def read_bytes(path: Path | str) -> bytes:
    """A file's whole content, decompressed when it ends in `.gz`."""
    path = Path(path)
    f = _opened(path)
    try:
        with f:
            return f.read()
    except _DECOMPRESSION as exc:
        raise _decompression_error(path, exc) from None
    except OSError as exc:
        raise DataError(path, f"cannot read ({exc.strerror or exc})") from None


def read_text(path: Path | str) -> str:
    """A UTF-8 text file's whole content, decompressed when it ends in `.gz`."""
    path = Path(path)
    data = read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(path, f"not UTF-8 text (byte {exc.start})") from None


def read_lines(path: Path | str) -> Iterator[str]:
    """The lines of a UTF-8 text file, newlines kept, read as they are consumed.

    A file that turns out truncated or damaged part-way raises `DataError` at that point, so a
    loader can stream a large trace and still report the damage against the file.
    """
    path = Path(path)
    f = _opened(path)
    text = io.TextIOWrapper(f, encoding="utf-8", newline="")
    with text:
        try:
            yield from text
        except _DECOMPRESSION as exc:
            raise _decompression_error(path, exc) from None
        except UnicodeDecodeError as exc:
            raise DataError(path, f"not UTF-8 text ({exc.reason})") from None
        except OSError as exc:
            raise DataError(path, f"cannot read ({exc.strerror or exc})") from None
