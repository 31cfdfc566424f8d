"""The embedded Redis's data directory (``--data-dir``).

Redis keeps its AOF files (``appendonlydir/``) and its log (``redis.log``)
there; feedsvc makes the directory and refuses, with one line, a path it
cannot use.
"""

from __future__ import annotations

from pathlib import Path

from feedsvc.config import UnusableSetting


def make_data_dir(path: Path) -> Path:
    """Make the data directory (and its parents) if missing; its absolute path.

    Raises:
        UnusableSetting: path is a file, or cannot be made.
    """
    path = Path(path).absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UnusableSetting(f"--data-dir {path} is not a directory") from None
    except OSError as exc:
        raise UnusableSetting(f"--data-dir {path} cannot be made: {exc.strerror or exc}") from None
    return path
